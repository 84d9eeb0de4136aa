"""`fuse_norms(model)`: a serving model's `RMSNorm`s computed by one C++ pass per row.

`FusedRMSNorm` keeps the module's own weight Parameter (names, checksums, weight updates and
`/get_weights_by_name` see nothing new) and its arithmetic (`csrc/rms_norm.cpp`: within a few ulps of
the module's, the sum of squares in another order, each row on its own). Inputs it does not
serve (another device or dtype) take the module's PyTorch form. Measured: docs/inference.md,
"Norms"."""

from __future__ import annotations

import torch
from torch import nn

from tandem.inference import cpu_kernels
from tandem.models.common import RMSNorm


class FusedRMSNorm(nn.Module):
    def __init__(self, norm: RMSNorm):
        super().__init__()
        self.weight = norm.weight  # the same Parameter object
        self.eps = norm.eps
        self._kernel = cpu_kernels.rms_norm()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (self._kernel is None or x.device.type != "cpu" or x.dtype not in (torch.float32, torch.bfloat16)
                or x.dtype != self.weight.dtype or x.stride(-1) != 1 or x.dim() < 2):
            return RMSNorm.forward(self, x)  # type: ignore[arg-type]  (the module's PyTorch form)
        rows = x[:, None] if x.dim() == 2 else x.flatten(0, -3)  # [A, B, D], heads read in place
        return self._kernel.rms_norm(rows, self.weight, self.eps).view(x.shape)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}, fused"


def fusing_available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether `fuse_norms` serves: CPU, float32 or bfloat16, the kernel built (kernels on)."""
    return device.type == "cpu" and dtype in (torch.float32, torch.bfloat16) and cpu_kernels.rms_norm() is not None


def fuse_norms(model: nn.Module) -> int:
    """Replace every `RMSNorm` under `model` by a `FusedRMSNorm`; -> how many."""
    targets = [(name, module) for name, module in model.named_modules() if type(module) is RMSNorm]
    for name, norm in targets:
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, attr, FusedRMSNorm(norm))
    return len(targets)

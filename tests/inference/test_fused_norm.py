"""The serving model's one-pass RMSNorm (`csrc/rms_norm.cpp`) against the trainer's module: within
a few float32 ulps (one bf16 ulp), each row independent of the others, NaN kept, and the model's parameters untouched."""

from __future__ import annotations

import pytest
import torch

from tandem.inference import cpu_kernels
from tandem.inference.fused_norm import FusedRMSNorm, fuse_norms
from tandem.models.common import RMSNorm


def test_the_kernel_builds_on_this_machine():
    assert cpu_kernels.rms_norm() is not None, "the RMSNorm kernel did not build (see the logged warning)"


def _norm(dim: int, dtype: torch.dtype) -> RMSNorm:
    torch.manual_seed(0)
    norm = RMSNorm(dim).to(dtype)
    norm.weight.data.normal_(1.0, 0.2)
    return norm


@pytest.mark.parametrize("dtype, ulps", [(torch.float32, 2 ** -21), (torch.bfloat16, 2 ** -7)])
@pytest.mark.parametrize("shape", [(200, 512), (33, 8, 64)], ids=["rows", "heads"])
def test_equals_the_module_within_a_few_ulps(dtype, ulps, shape):
    norm = _norm(shape[-1], dtype)
    fused = FusedRMSNorm(norm)
    x = (torch.randn(shape[0], *shape[1:-1], shape[-1] + 16) * 3).to(dtype)[..., 16:]  # a view, as q of a fused qkv
    ref, out = norm(x), fused(x)
    assert out.dtype == dtype and out.shape == ref.shape
    assert ((out.double() - ref.double()).abs() <= ref.double().abs() * ulps + 1e-30).all()
    assert (out == ref).float().mean() > 0.5  # most rows bit-equal: only the sum of squares is reordered


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_row_does_not_depend_on_its_batch(dtype):
    fused = FusedRMSNorm(_norm(256, dtype))
    x = torch.randn(64, 256).to(dtype)
    batch = fused(x)
    for i in (0, 17, 63):
        assert torch.equal(fused(x[i:i + 1]), batch[i:i + 1])


def test_nan_stays_in_its_row():
    fused = FusedRMSNorm(_norm(64, torch.float32))
    x = torch.randn(4, 64)
    x[1, 5] = float("nan")
    out = fused(x)
    assert out[1].isnan().all() and not out[[0, 2, 3]].isnan().any()


def test_fuse_norms_keeps_the_models_parameters(qwen3_dir):
    from tandem.models import load_model

    model = load_model(qwen3_dir, dtype=torch.float32, device="cpu")
    before = dict(model.named_parameters())
    keys = list(model.state_dict())
    assert fuse_norms(model) > 0
    assert dict(model.named_parameters()) == before and list(model.state_dict()) == keys
    assert not any(type(m) is RMSNorm for m in model.modules())

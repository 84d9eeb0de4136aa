"""Full HF-named tensors out of a (sharded) model, one at a time or in byte-bounded buckets.

Gathering a sharded parameter is a collective: every rank must gather the same parameters in the
same order. The order here is the model's `named_parameters()` order, which depends only on the
module structure, so it is identical on all ranks; bucket boundaries depend only on shapes and
dtypes, so they are identical too. Tied weights appear once (under the embedding's HF name).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn
from torch.distributed.tensor import DTensor


def hf_parameter_names(model: nn.Module) -> list[tuple[str, str, nn.Parameter]]:
    """(native name, HF name, parameter) in export order."""
    adapter = model.spec.state_dict_adapter_cls(model.args)
    return [(name, adapter.native_to_hf(name), p) for name, p in model.named_parameters()]


def _nbytes(param: torch.Tensor, dtype: torch.dtype | None) -> int:
    element = torch.empty((), dtype=dtype or param.dtype).element_size()
    return param.numel() * element  # numel of a DTensor is its global numel


@torch.no_grad()
def full_tensor(param: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The whole tensor on this rank (a collective for DTensors), cast to `dtype` when given.
    Casting happens on the local shard, before the gather, so bf16 export moves half the bytes."""
    t = param.detach()
    if dtype is not None:
        t = t.to(dtype)
    return t.full_tensor() if isinstance(t, DTensor) else t


def iter_hf_tensors_from_model(
    model: nn.Module, dtype: torch.dtype | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """`(hf_name, full tensor)` one parameter at a time. Collective: consume it on every rank."""
    for _, hf_name, param in hf_parameter_names(model):
        yield hf_name, full_tensor(param, dtype)


def iter_weight_buckets(
    model: nn.Module, bucket_bytes: int, dtype: torch.dtype | None = None
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Buckets of `(hf_name, full tensor)` of at most `bucket_bytes` each; a single tensor larger
    than the limit travels alone. A bucket is gathered only when asked for and is not referenced
    after the next one is requested, so at most one bucket is materialised at a time (as long as
    the caller drops it too). Collective: iterate it fully, on every rank."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    plan: list[list[tuple[str, nn.Parameter]]] = [[]]
    size = 0
    for _, hf_name, param in hf_parameter_names(model):
        nbytes = _nbytes(param, dtype)
        if plan[-1] and size + nbytes > bucket_bytes:
            plan.append([])
            size = 0
        plan[-1].append((hf_name, param))
        size += nbytes
    for entries in plan:
        if entries:
            yield [(name, full_tensor(param, dtype)) for name, param in entries]

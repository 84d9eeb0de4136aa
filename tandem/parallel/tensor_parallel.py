"""Generic tensor-parallel (TP) helpers; a model family's plan lives with the model (e.g.
`tandem.models.qwen.tensor_plan`). A plan leaves a `TensorParallelInfo` on the model (attribute
`tensor_parallel`): the head's `vocab_range` (its logits are a vocabulary slice; log-probs go
through `tandem.parallel.loss_parallel`) and the `partial_grad_params` whose gradients
`sum_partial_grads` adds up over the TP group before the optimizer or grad-norm clipping reads them."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from tandem.errors import ConfigError


@dataclass(frozen=True)
class TensorParallelInfo:
    """What a model's TP plan did, for the code that trains it.

    `mesh`: the 1-D TP mesh. `vocab_size`: the global vocabulary of the vocab-sharded head.
    `partial_grad_params`: names (as in `model.named_parameters()`) of plain parameters whose
    gradients each TP rank holds only a partial sum of."""

    mesh: DeviceMesh
    vocab_size: int
    partial_grad_params: tuple[str, ...] = ()

    @property
    def group(self) -> dist.ProcessGroup:
        return self.mesh.get_group()

    @property
    def size(self) -> int:
        return self.mesh.size()

    def vocab_range(self) -> tuple[int, int]:
        """[start, stop) of this rank's vocabulary slice: DTensor's `Shard(0)` layout, i.e.
        `ceil(vocab / tp)` rows per rank, fewer (or none) on the last ones."""
        return shard_range(self.vocab_size, self.size, self.mesh.get_local_rank())


def shard_range(total: int, parts: int, index: int) -> tuple[int, int]:
    """[start, stop) of chunk `index` when `total` rows are cut into `parts` ceil-sized chunks."""
    rows = -(-total // parts)
    return min(total, index * rows), min(total, (index + 1) * rows)


def check_divides(tp: int, **counts: int) -> None:
    """Raise `ConfigError` unless `tp` divides every count (e.g. attention heads), naming the
    first that it does not and the fix."""
    for name, count in counts.items():
        if count % tp:
            raise ConfigError(
                f"tensor parallel size tp={tp} must divide the model's {name} ({count}): choose a tp "
                f"(the 't' of actor.backend, e.g. archon:t2) that divides it"
            )


class _SumForwardOnly(torch.autograd.Function):
    """All-reduce (sum) in forward, identity in backward.

    For a value every TP rank then uses identically (a replicated loss): the gradient each rank
    receives already is the gradient of the one global loss, so passing it straight through is
    exact, whereas a differentiable all-reduce would sum the identical gradients (tp times)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:  # type: ignore[override]
        out = x.clone()
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        return grad, None


def sum_forward_only(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Sum of `x` over `group`'s ranks; its backward passes the gradient through unchanged (see
    `_SumForwardOnly`: right when every rank computes the same loss from the result)."""
    return _SumForwardOnly.apply(x, group)


@torch.no_grad()
def max_over(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Element-wise max of `x` over `group` (no gradient)."""
    out = x.detach().clone()
    dist.all_reduce(out, op=dist.ReduceOp.MAX, group=group)
    return out


@torch.no_grad()
def sum_partial_grads(model: nn.Module, info: TensorParallelInfo | None) -> None:
    """Sum the gradients of `info.partial_grad_params` over the TP group, in place and in one
    collective. Call once per optimizer step, after every backward and before anything reads
    the gradients (clipping, the optimizer). With FSDP these parameters are DTensors sharded over
    the data-parallel mesh only; their local shards line up across TP peers (same DP
    coordinate), so summing the local shards is summing the gradient. No-op without TP."""
    if info is None or not info.partial_grad_params:
        return
    params = dict(model.named_parameters())
    missing = [n for n in info.partial_grad_params if n not in params]
    if missing:
        raise KeyError(f"tensor_parallel.partial_grad_params names no parameter: {missing[:3]}")
    grads = [local_tensor(params[n].grad) for n in info.partial_grad_params if params[n].grad is not None]
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=info.group)
    offset = 0
    for g in grads:
        g.copy_(flat[offset: offset + g.numel()].view_as(g))
        offset += g.numel()


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's local tensor of a DTensor; a plain tensor as it is."""
    return t.to_local() if isinstance(t, DTensor) else t

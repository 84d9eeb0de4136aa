"""Expert parallelism (EP) and expert tensor parallelism (ETP): the collectives of a MoE layer.

`expert_parallel_dispatch` takes a layer's assignments sorted by expert, sends each row to the
rank holding its expert (rank q of P holds experts `[q * E/P, (q+1) * E/P)`; uneven, possibly empty
all-to-all splits), computes them grouped there and returns the outputs in the order the rows came.
Under ETP (`etp == tp`) the block runs on the TP group's tokens (`gather_tokens`) and sums its
partial output back onto the sequence shards (`reduce_scatter_tokens`). Everything is
differentiable (an expert's gradient sums every ep rank's tokens) and plain `torch.distributed`,
so gloo (CPU) and NCCL alike."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

Compute = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class _AllToAll(torch.autograd.Function):
    """`all_to_all_single` of the rows of `x` with uneven splits; backward swaps the splits."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, output_splits: list[int], input_splits: list[int],  # type: ignore[override]
                group: dist.ProcessGroup) -> torch.Tensor:
        ctx.splits, ctx.group = (output_splits, input_splits), group
        return _all_to_all(x, output_splits, input_splits, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        output_splits, input_splits = ctx.splits
        return _all_to_all(grad, input_splits, output_splits, ctx.group), None, None, None


def _all_to_all(x: torch.Tensor, output_splits: list[int], input_splits: list[int],
                group: dist.ProcessGroup) -> torch.Tensor:
    out = x.new_empty((sum(output_splits), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), output_splits, input_splits, group=group)
    return out


def all_to_all_rows(x: torch.Tensor, output_splits: list[int], input_splits: list[int],
                    group: dist.ProcessGroup) -> torch.Tensor:
    """Differentiable `all_to_all_single` over dim 0: `input_splits[q]` rows of `x` go to rank q,
    `output_splits[q]` rows arrive from it (in rank order)."""
    return _AllToAll.apply(x, output_splits, input_splits, group)


def expert_parallel_dispatch(x_sorted: torch.Tensor, counts: torch.Tensor, compute: Compute,
                             group: dist.ProcessGroup) -> torch.Tensor:
    """Outputs of the rows `x_sorted [N, dim]`, sorted by global expert id with `counts [E]` rows
    per expert, in the same order; each row is computed on the ep rank of `group` that holds its
    expert. `compute(rows, local_counts)` computes rows sorted by this rank's local expert
    (`local_counts [E / P]`), e.g. `grouped_swiglu` with the local expert weights. Collective over
    `group` (every rank calls it once per MoE layer, possibly with N = 0)."""
    ranks = dist.get_world_size(group)
    num_experts = counts.numel()
    if num_experts % ranks:
        raise ValueError(f"expert parallelism over {ranks} ranks needs the experts ({num_experts}) to divide evenly")
    local = num_experts // ranks
    counts = counts.to(torch.int64)
    # received[s, j]: rows rank s sends to this rank's local expert j.
    received = torch.empty_like(counts)
    dist.all_to_all_single(received, counts.contiguous(), group=group)
    received = received.view(ranks, local)
    # One host sync for all split sizes (the all-to-all needs them as Python ints).
    splits = torch.cat([counts.view(ranks, local).sum(1), received.sum(1)]).tolist()
    input_splits, output_splits = splits[:ranks], splits[ranks:]
    rows = all_to_all_rows(x_sorted, output_splits, input_splits, group)
    # Rows arrive by source rank, then by local expert: sort them by local expert (stable).
    local_expert = torch.repeat_interleave(torch.arange(local, device=counts.device).repeat(ranks),
                                           received.reshape(-1))
    order = torch.argsort(local_expert, stable=True)
    out = compute(rows[order], received.sum(0))
    back = torch.empty_like(order)
    back[order] = torch.arange(order.numel(), device=order.device)
    return all_to_all_rows(out[back], input_splits, output_splits, group)


class _GatherTokens(torch.autograd.Function):
    """All-gather of the sequence shards `[T / tp, ...]` -> `[T, ...]`; backward: reduce-scatter (sum)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:  # type: ignore[override]
        ctx.group = group
        return _all_gather(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        return _reduce_scatter(grad, ctx.group), None


class _ReduceScatterTokens(torch.autograd.Function):
    """Sum over the group of `[T, ...]` partial values, keeping this rank's shard `[T / tp, ...]`;
    backward: all-gather."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:  # type: ignore[override]
        ctx.group = group
        return _reduce_scatter(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        return _all_gather(grad, ctx.group), None


def _all_gather(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    x = x.contiguous()
    out = x.new_empty((x.shape[0] * dist.get_world_size(group), *x.shape[1:]))
    dist.all_gather_into_tensor(out, x, group=group)
    return out


def _reduce_scatter(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    ranks = dist.get_world_size(group)
    if x.shape[0] % ranks:
        raise ValueError(f"{x.shape[0]} tokens do not split evenly over {ranks} tensor-parallel ranks")
    x = x.contiguous()
    if x.device.type == "cpu":  # gloo has no reduce-scatter: all-reduce, keep this rank's rows
        summed = x.clone()
        dist.all_reduce(summed, group=group)
        return summed.chunk(ranks)[dist.get_rank(group)].clone()
    out = x.new_empty((x.shape[0] // ranks, *x.shape[1:]))
    dist.reduce_scatter_tensor(out, x, group=group)
    return out


def gather_tokens(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """The TP group's sequence shards of `x`, concatenated in rank order (differentiable)."""
    return _GatherTokens.apply(x, group)


def reduce_scatter_tokens(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """This rank's shard of the sum over the TP group of `x` (differentiable)."""
    return _ReduceScatterTokens.apply(x, group)

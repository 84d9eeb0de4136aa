"""Ulysses context parallelism: attention over a token stream split across the ranks of a CP group
(`ulysses_attention`), plus the token gather the trainer uses (`gather_tokens`).

Each rank holds a contiguous `T_local` slice (the same on every rank: the caller pads to a multiple
of `cp`) with q/k/v for all heads; one all-to-all per tensor gives it all tokens for `1/cp` of the
heads, the passed-in kernel (bound to the full `cu_seqlens`) attends over the whole stream, and a
second all-to-all swaps back. Exact and differentiable; KV heads are repeated up to
`lcm(H_kv, cp)` when `cp` does not divide them. No model imports. See docs/training.md,
"Context parallelism"."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from tandem.parallel.cp_heads import check_heads, kv_repeats

__all__ = ["check_heads", "gather_tokens", "heads_to_tokens", "kv_repeats", "tokens_to_heads", "ulysses_attention"]

Kernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class _AllToAll(torch.autograd.Function):
    """Equal-split all-to-all along dim 0; its gradient is the same exchange run backwards
    (chunk i of the output came from rank i, so its gradient goes back to rank i)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:  # type: ignore[override]
        ctx.group = group
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        out = torch.empty_like(grad, memory_format=torch.contiguous_format)
        dist.all_to_all_single(out, grad.contiguous(), group=ctx.group)
        return out, None


def _swap(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Differentiable equal-split all-to-all along dim 0 (`[cp, ...]` chunk i goes to rank i)."""
    return _AllToAll.apply(x, group)


def heads_to_tokens(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """`[T_local, H, D]` (this rank's tokens, all heads) -> `[cp * T_local, H / cp, D]` (all tokens
    in stream order, this rank's heads). `H` must be divisible by the group size."""
    cp = dist.get_world_size(group)
    t_local, heads, dim = x.shape
    chunks = x.reshape(t_local, cp, heads // cp, dim).transpose(0, 1).contiguous()  # [cp, T_l, H/cp, D]
    return _swap(chunks, group).reshape(cp * t_local, heads // cp, dim)  # chunk s = rank s's tokens


def tokens_to_heads(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Inverse of `heads_to_tokens`: `[cp * T_local, h, D]` -> `[T_local, cp * h, D]`."""
    cp = dist.get_world_size(group)
    tokens, heads, dim = x.shape
    back = _swap(x.reshape(cp, tokens // cp, heads, dim).contiguous(), group)  # chunk s = rank s's heads
    return back.transpose(0, 1).reshape(tokens // cp, cp * heads, dim)


def ulysses_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kernel: Kernel, group: dist.ProcessGroup
) -> torch.Tensor:
    """Attention of this rank's tokens against the whole stream of the CP `group`.

    q `[T_local, H, D]`, k/v `[T_local, H_kv, D]`, the same `T_local` on every rank (rank r holds
    stream tokens `[r*T_local, (r+1)*T_local)`). `kernel(q, k, v)` is the single-device attention
    over the whole stream (`[T, h, D]` -> `[T, h, D]`, GQA allowed), e.g. packed causal attention
    bound to the full `cu_seqlens` and the scale. Returns `[T_local, H, D]`. Collective over `group`.
    """
    cp = dist.get_world_size(group)
    if cp == 1:
        return kernel(q, k, v)
    repeats = kv_repeats(q.shape[1], k.shape[1], cp)
    if repeats > 1:
        k, v = k.repeat_interleave(repeats, dim=1), v.repeat_interleave(repeats, dim=1)
    out = kernel(heads_to_tokens(q, group), heads_to_tokens(k, group), heads_to_tokens(v, group))
    return tokens_to_heads(out, group)


class _GatherTokens(torch.autograd.Function):
    """All-gather along dim 0; backward averages the incoming gradient over the group and keeps
    this rank's slice (see `gather_tokens`)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:  # type: ignore[override]
        ctx.group, ctx.n = group, x.shape[0]
        out = x.new_empty((dist.get_world_size(group) * x.shape[0], *x.shape[1:]))
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # renamed in torch 2.13
        gather(out, x.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        start = dist.get_rank(ctx.group) * ctx.n
        return grad[start : start + ctx.n] / dist.get_world_size(ctx.group), None


def gather_tokens(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """`[n, ...]` per rank -> `[cp * n, ...]` (rank order) on every rank of `group`; differentiable.

    Contract for the gradient: every rank computes the SAME function of the gathered tensor (e.g.
    the loss of the whole micro-batch, replicated over the CP group), so the copies' gradients are
    averaged, and each rank back-propagates its own slice's share. Summed over the ranks (as FSDP's
    reduce-scatter does) that is the gradient of one copy of the function, not `cp` copies.
    """
    if dist.get_world_size(group) == 1:
        return x
    return _GatherTokens.apply(x, group)

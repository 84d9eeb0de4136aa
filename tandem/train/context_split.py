"""Splitting one packed micro-batch over the ranks of a context-parallel (CP) group.

All CP ranks of a data-parallel shard receive the same micro-batches (`T` tokens, `cu_seqlens`).
The stream is padded to `T_pad`, the next multiple of `cp`, and rank r runs the model on tokens
`[r*T_pad/cp, (r+1)*T_pad/cp)` only: its input ids and their TRUE positions (computed from the full
`cu_seqlens` before slicing, so a document cut by a slice boundary keeps counting). Attention is
Ulysses (`tandem.parallel.context_parallel`) over the full `cu_seqlens`; padding tokens sit after
the last document and only attend among themselves. Everything that compares a token with its
successor (next-token labels, loss positions) is computed on the full stream before slicing,
since position t predicts t+1, which may live on the next rank.

Only the per-token log-probs and entropy (`[T_pad/cp]` floats) are gathered back, so every CP rank
returns the full `[T]` results and runs the (cheap) loss on the whole micro-batch, exactly as one
rank would: any loss works unchanged, per-sequence ones included, and the loss normaliser and
statistics are counted once per DP shard, not once per CP rank. `gather_tokens` averages the loss
gradient over the CP ranks and each rank back-propagates its own tokens' share; FSDP then sums the
parameter gradients over `dp_shard x cp`, which yields the single-rank gradient.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch
import torch.distributed as dist

from tandem.models.common import packed_causal_attention
from tandem.parallel.context_parallel import gather_tokens, ulysses_attention


@dataclass(frozen=True)
class ContextSplit:
    """This rank's contiguous slice of a packed stream of `num_tokens` tokens over a CP group."""

    group: dist.ProcessGroup
    num_tokens: int
    cp: int
    rank: int

    @classmethod
    def of(cls, num_tokens: int, group: dist.ProcessGroup) -> ContextSplit:
        return cls(group, num_tokens, dist.get_world_size(group), dist.get_rank(group))

    @property
    def padded(self) -> int:
        """`num_tokens` rounded up to a multiple of `cp`."""
        return -(-self.num_tokens // self.cp) * self.cp

    @property
    def local_tokens(self) -> int:
        return self.padded // self.cp

    @property
    def start(self) -> int:
        return self.rank * self.local_tokens

    def local(self, x: torch.Tensor, fill: float | bool = 0) -> torch.Tensor:
        """This rank's slice of a per-token tensor `[T, ...]` (padding positions hold `fill`)."""
        if x.shape[0] != self.num_tokens:
            raise ValueError(f"expected {self.num_tokens} tokens along dim 0, got {tuple(x.shape)}")
        if self.padded > self.num_tokens:
            x = torch.cat([x, x.new_full((self.padded - self.num_tokens, *x.shape[1:]), fill)])
        return x[self.start : self.start + self.local_tokens]

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's slice `[T_pad/cp, ...]` -> the whole stream `[T, ...]` (padding dropped);
        differentiable under the contract of `gather_tokens` (replicated consumers)."""
        return gather_tokens(x, self.group)[: self.num_tokens]

    def attention(self, cu_seqlens: torch.Tensor):  # -> tandem.models.qwen.model.AttentionBackend
        """The model's attention hook (`attn(layer, q, k, v)`) for this slice: Ulysses over the CP
        group with packed causal attention on the full stream (`cu_seqlens` of the whole micro-batch)."""

        def attn(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            del layer
            kernel = partial(packed_causal_attention, cu_seqlens=cu_seqlens, scale=q.shape[-1] ** -0.5)
            return ulysses_attention(q, k, v, kernel, self.group)

        return attn

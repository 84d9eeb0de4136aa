"""Splitting one packed micro-batch over the ranks of a context-parallel (CP) group.

The stream is padded to a multiple of `cp` (times tensor parallelism's token multiple) and rank r runs the model on its contiguous slice: input
ids with their TRUE positions (from the full `cu_seqlens`). Next-token labels and loss positions are
computed on the full stream before slicing (t predicts t+1, which may live on the next rank); only
the per-token log-probs and entropy are gathered back, so every CP rank returns the full `[T]`
results and runs any loss unchanged, counted once per DP shard. See docs/training.md, "Context
parallelism"."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from tandem.parallel.context_parallel import Kernel, gather_tokens, ulysses_attention


@dataclass(frozen=True)
class ContextSplit:
    """This rank's contiguous slice of a packed stream of `num_tokens` tokens over a CP group.
    `multiple`: every slice's length is a multiple of it (tensor parallelism's token multiple), so
    the model pads no slice: padding inside a slice would shift the next ranks' tokens in the
    stream that Ulysses attention reassembles."""

    group: dist.ProcessGroup
    num_tokens: int
    cp: int
    rank: int
    multiple: int = 1

    @classmethod
    def of(cls, num_tokens: int, group: dist.ProcessGroup, multiple: int = 1) -> ContextSplit:
        return cls(group, num_tokens, dist.get_world_size(group), dist.get_rank(group), multiple)

    @property
    def padded(self) -> int:
        """`num_tokens` rounded up to a multiple of `cp * multiple`."""
        step = self.cp * self.multiple
        return -(-self.num_tokens // step) * step

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

    def attention(self, kernel: Kernel):  # -> tandem.models.qwen.model.AttentionBackend
        """The model's attention hook (`attn(layer, q, k, v)`) for this slice: Ulysses over the CP
        group, `kernel` the packed causal attention of the whole stream (`padded` tokens; the
        model's `packed_attention` for the micro-batch's full `cu_seqlens`)."""

        def attn(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            del layer
            return ulysses_attention(q, k, v, kernel, self.group)

        return attn

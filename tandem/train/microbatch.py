"""Splitting a rank's batch into micro-batches, agreeing on their count across DP ranks, and
putting per-sequence results back in the original order.

Partitioning itself is `tandem.data.balance` (FFD bin packing or Karmarkar–Karp, the latter on the
cost of `actor.balance`); this module only decides how many micro-batches there are. Every rank must run the same number of forward/backward
passes, because each pass issues FSDP all-gathers and reduce-scatters that all ranks must join: the
count is all-reduced (max) over the data-parallel group and ranks short of it pad with empty
micro-batches.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TypeVar

import torch
import torch.distributed as dist

from tandem.data.balance import ffd_pack, karmarkar_karp, part_loads
from tandem.data.batch import MicroBatch, SequenceBatch, pack_sequences
from tandem.train.config import MicroBatchConfig

T = TypeVar("T")


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _partition(lengths: list[int], costs: list[float], k: int, capacity: float, packing: str) -> list[list[int]]:
    """At least `k` parts (exactly k when n >= k, else n), each under `capacity` tokens; kk evens
    out `costs`, ffd fills by tokens."""
    n = len(lengths)
    if n == 0:
        return []
    k = min(k, n)
    if packing == "ffd":
        return ffd_pack(lengths, capacity, min_bins=k)
    # Karmarkar–Karp: the most even split into k parts; add parts until the budget holds.
    while True:
        parts = karmarkar_karp(costs, k)
        if max(part_loads(lengths, parts)) <= capacity:
            return parts
        if k == n:  # unreachable: every item fits alone (checked by the caller)
            raise AssertionError("a single sequence exceeds the micro-batch budget")
        k += 1


def _split_to(costs: list[float], parts: list[list[int]], target: int) -> list[list[int]]:
    """Split the costliest multi-sequence part in two (evenly in `costs`, by KK) until there are
    `target` parts or every part is a single sequence; splitting never breaks a budget."""
    parts = [list(p) for p in parts]
    while len(parts) < target:
        splittable = [i for i, p in enumerate(parts) if len(p) > 1]
        if not splittable:
            break
        i = max(splittable, key=lambda i: (sum(costs[j] for j in parts[i]), -i))
        old = parts[i]
        left, right = karmarkar_karp([costs[j] for j in old], 2)
        parts[i] = [old[j] for j in left]
        parts.append([old[j] for j in right])
    return parts


def agree_on_count(count: int, group: dist.ProcessGroup | None, device: torch.device | str) -> int:
    """Max of `count` over the ranks of `group` (`count` itself outside a process group)."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return count
    t = torch.tensor([count], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return int(t.item())


def plan_micro_batches(
    lengths: Sequence[int],
    config: MicroBatchConfig,
    group: dist.ProcessGroup | None = None,
    device: torch.device | str = "cpu",
    costs: Sequence[float] | None = None,
) -> list[list[int]]:
    """Index groups into `lengths`, one per micro-batch; `[]` marks a padding micro-batch.

    The token budget always bounds a micro-batch (it stands for memory). `costs` (one per
    sequence, default the lengths: `actor.balance`) is what `packing="kk"` evens out; ffd packs
    by tokens, as its job is the fewest micro-batches under the budget.
    Collective over `group` when a process group exists: call it on every DP rank.
    """
    lengths = [int(n) for n in lengths]
    if costs is not None and len(costs) != len(lengths):
        raise ValueError(f"{len(costs)} costs for {len(lengths)} sequences")
    even = [float(c) for c in (costs if costs is not None and config.packing == "kk" else lengths)]
    capacity = float(config.max_tokens_per_mb) if config.max_tokens_per_mb else math.inf
    for i, n in enumerate(lengths):
        if n > capacity:
            raise ValueError(
                f"sequence {i} has {n} tokens, more than max_tokens_per_mb={config.max_tokens_per_mb}; "
                "raise the budget or truncate the sequence"
            )
    parts = _partition(lengths, even, config.n_mbs, capacity, config.packing)
    target = _round_up(agree_on_count(max(len(parts), config.n_mbs), group, device), config.n_mbs_divisor)
    if len(parts) < target and len(parts) < len(lengths):
        more = _partition(lengths, even, target, capacity, config.packing)
        parts = more if len(more) == min(target, len(lengths)) else _split_to(even, parts, target)
    return parts + [[] for _ in range(target - len(parts))]


def build_micro_batches(batch: SequenceBatch, plan: Sequence[Sequence[int]]) -> list[MicroBatch]:
    return [pack_sequences(batch, indices) for indices in plan]


def restore_order(mbs: Sequence[MicroBatch], per_mb: Sequence[Sequence[T]], n: int) -> list[T]:
    """`per_mb[i][j]` is the result for sequence `mbs[i].indices[j]`; returns the n results in
    original batch order."""
    out: list[T | None] = [None] * n
    for mb, results in zip(mbs, per_mb, strict=True):
        if len(results) != len(mb.indices):
            raise ValueError(f"micro-batch has {len(mb.indices)} sequences but {len(results)} results")
        for index, result in zip(mb.indices, results, strict=True):
            out[index] = result
    missing = [i for i, r in enumerate(out) if r is None]
    if missing:
        raise ValueError(f"no result for sequences {missing[:10]}")
    return out  # type: ignore[return-value]

"""Partitioning for data-parallel load balancing.

The controller splits each RL batch across DP ranks with `karmarkar_karp` (on token counts or
`sequence_cost`), and each rank packs its shard into micro-batches with `ffd_pack`. Every function
returns lists of INDICES into `values`, each index exactly once.

Determinism matters: ranks call these independently and must agree. All ties (equal values, equal
loads) are broken by index or creation order, never by hashing or object identity, so the same
input gives the same output on every rank and every run.

Output order, for all functions: indices ascending inside a part; parts by descending load, ties by
their smallest index. No part is ever empty (hence n >= k is required).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence

__all__ = ["ffd_pack", "greedy_partition", "imbalance", "karmarkar_karp", "part_loads", "sequence_cost"]

COSTS = ("tokens", "flops")
# A part is (load, item count, indices). Parts are compared as tuples: by load, then count, then
# indices, which only happens for equal load and count, where disjoint lists differ at once.


def _check(values: Sequence[float], k: int | None = None, equal_size: bool = False) -> list[float]:
    vals = [float(v) for v in values]
    for i, v in enumerate(vals):
        if not (v >= 0.0 and math.isfinite(v)):  # `not >=` also catches NaN
            raise ValueError(f"values[{i}] = {v!r}: values must be finite and non-negative")
    if k is None:
        return vals
    n = len(vals)
    if k < 1:
        raise ValueError(f"k must be >= 1, got k={k}")
    if n < k:
        raise ValueError(
            f"k={k} is larger than len(values)={n}: some rank would get no items; pad the batch or lower k"
        )
    if equal_size and n % k:
        raise ValueError(f"equal_size=True needs len(values)={n} to be divisible by k={k}")
    return vals


def _finish(vals: list[float], parts: list[list[int]]) -> list[list[int]]:
    """Canonical order: indices ascending, parts by (descending load, smallest index)."""
    out = [sorted(p) for p in parts]
    out.sort(key=lambda p: (-sum(vals[i] for i in p), p[0]))
    return out


def _join(a: tuple, b: tuple) -> tuple:
    # Extend the longer list with the shorter (small-to-large): O(n log n) copying overall, where
    # building new lists would be O(n^2 / k) when one partition absorbs many singletons.
    ia, ib = (a[2], b[2]) if len(a[2]) >= len(b[2]) else (b[2], a[2])
    ia.extend(ib)  # safe: every list belongs to exactly one live partition
    return (a[0] + b[0], a[1] + b[1], ia)


def karmarkar_karp(values: Sequence[float], k: int, equal_size: bool = False) -> list[list[int]]:
    """Largest differencing method (Karmarkar–Karp) for k-way partitioning.

    Keeps a max-heap of partial k-way partitions keyed by spread (max - min part load). Each step
    pops the two with the largest spread and merges them part-wise, pairing the lightest part of one
    with the heaviest of the other, which cancels most of both spreads. O(n·k·log k + n log n).
    The final spread is at most the largest item, so max load <= mean + largest item.

    `equal_size=True` starts from the sorted items in consecutive chunks of k (one item per part),
    so every merge keeps part sizes equal and each part ends with exactly n/k items. Otherwise each
    item starts alone in one part (k-1 empty ones), and no part ends empty (n >= k is required).

    The chunked start puts exactly one item of every chunk in each part, so on long-tailed values
    the part holding the largest item cannot shed enough load (4096 log-normal lengths, k = 64:
    max/mean 1.12, see bench/balance.py). With `equal_size` the LPT-with-room result is therefore
    computed too and returned instead when its max load is strictly lower.
    """
    vals = _check(values, k, equal_size)
    parts = _finish(vals, _ldm(vals, k, equal_size))
    if equal_size:
        lpt = greedy_partition(vals, k, equal_size=True)
        if max(part_loads(vals, lpt)) < max(part_loads(vals, parts)):
            return lpt
    return parts


def _ldm(vals: list[float], k: int, equal_size: bool) -> list[list[int]]:
    """The differencing itself, on validated values; parts in no particular order."""
    n = len(vals)
    # A partition stores only its non-empty parts, ascending; the other k - len(parts) are empty
    # (load 0) and implicitly first. Merges then cost O(parts used), not O(k), while most are empty.
    # Heap entries: (-spread, seq, parts); seq is unique, so ties never compare the parts.
    heap: list[tuple[float, int, list[tuple]]] = []
    if equal_size:
        order = sorted(range(n), key=lambda i: (vals[i], i))
        for c in range(n // k):
            chunk = [(vals[i], 1, [i]) for i in order[c * k : (c + 1) * k]]  # ascending already
            heap.append((chunk[0][0] - chunk[-1][0], c, chunk))
    else:
        heap = [(-v, i, [(v, 1, [i])]) for i, v in enumerate(vals)]
    heapq.heapify(heap)
    seq = len(heap)
    while len(heap) > 1:
        a = heapq.heappop(heap)[2]
        b = heapq.heappop(heap)[2]
        # Over all k slots, a ascending meets b descending. a's non-empty parts fill the last
        # len(a) slots and b's (descending) the first len(b), so they overlap in t slots, where
        # a[x] meets b[t-1-x]; the rest of each pairs with an empty part and is kept as is.
        t = len(a) + len(b) - k
        if t > 0:
            merged = [_join(a[x], b[t - 1 - x]) for x in range(t)]
            merged += b[t:]
            merged += a[t:]
        else:
            merged = a + b
        merged.sort()
        low = merged[0][0] if len(merged) == k else 0.0
        heapq.heappush(heap, (low - merged[-1][0], seq, merged))
        seq += 1
    return [p[2] for p in heap[0][2]]


def greedy_partition(values: Sequence[float], k: int, equal_size: bool = False) -> list[list[int]]:
    """Longest-processing-time greedy: items by descending value, each to the lightest part (with
    room, when `equal_size`). Baseline and fallback; without `equal_size`, max load <= 4/3 · optimum."""
    vals = _check(values, k, equal_size)
    room = len(vals) // k if equal_size else len(vals)
    parts: list[list[int]] = [[] for _ in range(k)]
    heap = [(0.0, 0, p) for p in range(k)]  # (load, count, part): count/part break ties
    for i in sorted(range(len(vals)), key=lambda i: (-vals[i], i)):
        load, count, p = heapq.heappop(heap)
        parts[p].append(i)
        if count + 1 < room:  # a full part leaves the heap for good
            heapq.heappush(heap, (load + vals[i], count + 1, p))
    return _finish(vals, parts)


def ffd_pack(
    values: Sequence[float], capacity: float, min_bins: int = 1, bin_multiple: int = 1
) -> list[list[int]]:
    """First-fit decreasing bin packing: micro-batches under a token (or cost) budget.

    The bin count is max(FFD's count, `min_bins`) rounded up to a multiple of `bin_multiple`. When
    that is more than FFD needed, the items are re-balanced over the larger count with KK if every
    bin still fits; otherwise FFD's heaviest splittable bins are split in two until the count is
    reached. Every bin is non-empty. Raises ValueError if an item exceeds `capacity` (no micro-batch
    can hold it) or the count exceeds the number of items (pad the batch). Empty input gives [].
    First-fit is O(n · bins).
    """
    vals = _check(values)
    if not capacity > 0:
        raise ValueError(f"capacity must be > 0, got capacity={capacity!r}")
    if min_bins < 1:
        raise ValueError(f"min_bins must be >= 1, got min_bins={min_bins}")
    if bin_multiple < 1:
        raise ValueError(f"bin_multiple must be >= 1, got bin_multiple={bin_multiple}")
    for i, v in enumerate(vals):
        if v > capacity:
            raise ValueError(f"values[{i}] = {v!r} exceeds capacity={capacity!r}: no bin can hold it")
    if not vals:
        return []
    loads: list[float] = []
    bins: list[list[int]] = []
    for i in sorted(range(len(vals)), key=lambda i: (-vals[i], i)):
        for b, load in enumerate(loads):
            if load + vals[i] <= capacity:
                loads[b] += vals[i]
                bins[b].append(i)
                break
        else:
            loads.append(vals[i])
            bins.append([i])
    target = -(-max(len(bins), min_bins) // bin_multiple) * bin_multiple
    if target > len(vals):
        raise ValueError(
            f"need {target} bins (min_bins={min_bins}, bin_multiple={bin_multiple}) but there are only "
            f"{len(vals)} items: some micro-batch would be empty; pad the batch or lower min_bins"
        )
    if target > len(bins):
        kk = karmarkar_karp(vals, target)
        if max(part_loads(vals, kk)) <= capacity:
            return kk
        while len(bins) < target:  # splitting never raises a load, so capacity still holds
            b = max((b for b in range(len(bins)) if len(bins[b]) > 1), key=lambda b: (loads[b], -b))
            left, right = karmarkar_karp([vals[i] for i in bins[b]], 2)
            old = bins[b]
            bins[b], loads[b] = [old[j] for j in left], sum(vals[old[j]] for j in left)
            bins.append([old[j] for j in right])
            loads.append(sum(vals[old[j]] for j in right))
    return _finish(vals, bins)


def sequence_cost(
    lengths: Sequence[int],
    cost: str = "tokens",
    *,
    hidden_size: int | None = None,
    num_layers: int | None = None,
) -> list[float]:
    """Per-sequence cost for balancing: "tokens" = L, or "flops" = a·L + L² with a = 12·h.

    Derivation (forward, per layer, per sequence of L tokens, hidden size h): the linear layers
    cost ~24·h² FLOPs per token (QKV+O: 4 h×h matmuls at 2 FLOPs per multiply-add = 8h²; an MLP
    with 4h intermediate, or SwiGLU with 8/3·h, = 16h²), so 24·h²·L; attention scores and the
    weighted sum cost 4·h·L per token for full attention, halved by the causal mask: 2·h·L².
    Total 2h·(12h·L + L²), so a = 12·h (c = 12). GQA and other MLP widths move c by tens of
    percent, which barely changes a balance. The common factor 2h·num_layers does not change a
    partition either: it is applied only when `num_layers` is given, to return absolute FLOPs.
    """
    if cost not in COSTS:
        raise ValueError(f"cost={cost!r} is not one of {', '.join(map(repr, COSTS))}")
    lens = _check(lengths)
    if cost == "tokens":
        return lens
    if hidden_size is None or hidden_size < 1:
        raise ValueError(f'cost="flops" needs hidden_size >= 1, got hidden_size={hidden_size!r}')
    if num_layers is not None and num_layers < 1:
        raise ValueError(f"num_layers must be >= 1, got num_layers={num_layers!r}")
    a = 12.0 * hidden_size
    scale = 1.0 if num_layers is None else 2.0 * hidden_size * num_layers
    return [scale * (a * L + L * L) for L in lens]


def part_loads(values: Sequence[float], parts: Sequence[Sequence[int]]) -> list[float]:
    """Sum of `values` over each part."""
    return [float(sum(values[i] for i in p)) for p in parts]


def imbalance(values: Sequence[float], parts: Sequence[Sequence[int]]) -> float:
    """Max part load / mean part load: 1.0 is perfect; 1.0 also when every load is zero."""
    loads = part_loads(values, parts)
    if not loads:
        raise ValueError("parts must not be empty")
    mean = sum(loads) / len(loads)
    return max(loads) / mean if mean > 0 else 1.0

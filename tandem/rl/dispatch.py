"""Splitting a training batch across data-parallel ranks, balanced by cost (Karmarkar–Karp)."""

from __future__ import annotations

from tandem.data.balance import imbalance, karmarkar_karp, sequence_cost
from tandem.data.batch import SequenceBatch


def split_for_ranks(
    batch: SequenceBatch, n_ranks: int, cost: str = "tokens", hidden_size: int | None = None
) -> tuple[list[SequenceBatch], dict[str, float]]:
    """One shard per rank. Equal-size parts when the batch divides evenly (every rank then runs the
    same number of sequences); the stats compare the naive contiguous split with the balanced one."""
    lengths = batch.lengths
    if n_ranks == 1:
        return [batch], {"dispatch/imbalance": 1.0}
    if len(lengths) < n_ranks:
        raise ValueError(f"{len(lengths)} sequences cannot feed {n_ranks} data-parallel ranks")
    costs = sequence_cost(lengths, cost, hidden_size=hidden_size)
    parts = karmarkar_karp(costs, n_ranks, equal_size=len(lengths) % n_ranks == 0)
    size = -(-len(lengths) // n_ranks)
    naive = [list(range(i, min(i + size, len(lengths)))) for i in range(0, len(lengths), size)]
    stats = {
        "dispatch/imbalance_naive": imbalance(costs, naive),
        "dispatch/imbalance": imbalance(costs, parts),
    }
    return [batch.select(part) for part in parts], stats

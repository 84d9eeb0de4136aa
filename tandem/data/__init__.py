"""Data handling: batch partitioning for data-parallel load balancing."""

from tandem.data.balance import (
    ffd_pack,
    greedy_partition,
    imbalance,
    karmarkar_karp,
    part_loads,
    sequence_cost,
)

__all__ = ["ffd_pack", "greedy_partition", "imbalance", "karmarkar_karp", "part_loads", "sequence_cost"]

"""Splitting a training batch across data-parallel ranks, balanced by cost (Karmarkar–Karp)."""

from __future__ import annotations

from tandem.data.balance import COSTS, imbalance, karmarkar_karp, sequence_cost
from tandem.data.batch import SequenceBatch
from tandem.errors import ModelConfigError
from tandem.models.hf_checkpoint import read_hf_config


def model_hidden_size(path: str) -> int:
    """`hidden_size` of the HF model directory `path` (its config.json): what the FLOP cost needs."""
    config = read_hf_config(path)
    size = config.get("hidden_size")
    if not isinstance(size, int) or size < 1:
        raise ModelConfigError(f"{path}/config.json has no positive integer hidden_size (got {size!r}): the FLOP "
                               "cost of actor.balance and the dispatch/imbalance_flops metric need it")
    return size


def split_for_ranks(
    batch: SequenceBatch, n_ranks: int, cost: str = "tokens", hidden_size: int | None = None
) -> tuple[list[SequenceBatch], dict[str, float]]:
    """One shard per rank, balanced by `cost` ("tokens" or "flops", `actor.balance`; "flops" needs
    the model's `hidden_size`). Equal-size parts when the batch divides evenly (every rank then
    runs the same number of sequences).

    The stats give max/mean load over the ranks: `dispatch/imbalance` of the balanced split and
    `dispatch/imbalance_naive` of the contiguous one, both in `cost`; and, when `hidden_size` is
    given, each split in both costs (`dispatch/imbalance_tokens|flops`,
    `dispatch/imbalance_naive_tokens|flops`), so a run shows what balancing by one cost does to
    the other."""
    if cost not in COSTS:
        raise ValueError(f"cost={cost!r} is not one of {', '.join(map(repr, COSTS))} (actor.balance)")
    if cost == "flops" and hidden_size is None:
        raise ValueError('cost="flops" needs the model\'s hidden_size')
    lengths = batch.lengths
    measured = COSTS if hidden_size is not None else ("tokens",)
    if n_ranks == 1:
        ones = {f"dispatch/imbalance{kind}_{c}": 1.0 for kind in ("", "_naive") for c in measured}
        return [batch], {"dispatch/imbalance": 1.0, "dispatch/imbalance_naive": 1.0, **ones}
    if len(lengths) < n_ranks:
        raise ValueError(f"{len(lengths)} sequences cannot feed {n_ranks} data-parallel ranks")
    costs = {c: sequence_cost(lengths, c, hidden_size=hidden_size) for c in measured}
    parts = karmarkar_karp(costs[cost], n_ranks, equal_size=len(lengths) % n_ranks == 0)
    size = -(-len(lengths) // n_ranks)
    naive = [list(range(i, min(i + size, len(lengths)))) for i in range(0, len(lengths), size)]
    stats = {
        "dispatch/imbalance_naive": imbalance(costs[cost], naive),
        "dispatch/imbalance": imbalance(costs[cost], parts),
    }
    for c in measured:
        stats[f"dispatch/imbalance_{c}"] = imbalance(costs[c], parts)
        stats[f"dispatch/imbalance_naive_{c}"] = imbalance(costs[c], naive)
    return [batch.select(part) for part in parts], stats

"""`TrainController` sends each rank the shard of its data-parallel rank (TP, CP and PP peers get
the same one) and returns per-DP-rank results from each DP group's first rank."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest

from tandem.train.config import TrainEngineConfig
from tandem.train.controller import TrainController


class RecordingGroup:
    """Stands in for a `WorkerGroup`: records what each rank would receive, answers with it."""

    def __init__(self, world_size: int):
        self.world_size = world_size
        self.sent: list[Sequence[Any]] = []

    def call(self, method, *args, **kwargs):
        return [None] * self.world_size

    def call_per_rank(self, method, args_per_rank, kwargs=None):
        self.sent = [args[0] for args in args_per_rank]
        return [(rank, args[0]) for rank, args in enumerate(args_per_rank)]


@pytest.mark.parametrize(("layout", "per_rank", "leaders"), [
    ({}, ["s0", "s1", "s2", "s3"], [0, 1, 2, 3]),
    ({"tp": 2}, ["s0", "s0", "s1", "s1"], [0, 2]),
    ({"cp": 2}, ["s0", "s0", "s1", "s1"], [0, 2]),
    ({"pp": 2}, ["s0", "s1", "s0", "s1"], [0, 1]),
    ({"pp": 2, "tp": 2}, ["s0"] * 4, [0]),
])
def test_shards_follow_the_data_parallel_rank(layout, per_rank, leaders):
    group = RecordingGroup(4)
    trainer = TrainController(group)  # type: ignore[arg-type]
    trainer.initialize(TrainEngineConfig(**layout))
    shards = [f"s{d}" for d in range(trainer.dp_size)]
    trainer.sft_step(shards)  # type: ignore[arg-type]
    assert group.sent == per_rank
    assert trainer.compute_logprobs(shards) == [(r, per_rank[r]) for r in leaders]  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=f"3 shards for {trainer.dp_size} data-parallel ranks"):
        trainer.ppo_update(["a", "b", "c"], None, 0, 1.0, 1)  # type: ignore[arg-type]


def test_a_layout_that_does_not_divide_the_ranks_is_refused():
    with pytest.raises(ValueError, match=r"tp \* pp \* cp = 3 does not divide the 4 trainer ranks"):
        TrainController(RecordingGroup(4)).initialize(TrainEngineConfig(tp=3))  # type: ignore[arg-type]

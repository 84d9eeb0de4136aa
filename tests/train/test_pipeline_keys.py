"""The pipeline keys (`actor.parallelize.pp_schedule`, `pp_stages_per_rank`, `pp_microbatches`)
on a real two-rank pipeline (gloo, spawned processes): one training step per setting, and the
torch schedule it ran, the stages each rank holds and the number of micro-batches. The numbers
each schedule computes are compared with one rank in test_engine_pipeline.py; this shows the keys
choose what runs."""

from __future__ import annotations

import pytest

from tests.distributed import run_distributed
from tests.train.pp_workers import make_model, pipeline_key_checks

pytestmark = pytest.mark.slow


def test_pipeline_keys_choose_the_schedule_stages_and_micro_batches(tmp_path):
    """Catches a pipeline key that stops reaching the pipeline runner: each setting must run its
    own schedule, stage layout and micro-batch count."""
    model = make_model(tmp_path / "m", tied=False, n_layers=6)
    ranks = run_distributed(pipeline_key_checks, 2, args=(str(model),), timeout=600)
    for rank, got in enumerate(ranks):
        print(f"\nrank {rank}: {got}")
    assert [r["default"] for r in ranks] == [("Schedule1F1B", [0], 2), ("Schedule1F1B", [1], 2)]
    assert [r["I1F1B"] for r in ranks] == [("ScheduleInterleaved1F1B", [0, 2], 4),
                                           ("ScheduleInterleaved1F1B", [1, 3], 4)]
    assert [r["IZB-3"] for r in ranks] == [("ScheduleInterleavedZeroBubble", [0, 2, 4], 6),
                                           ("ScheduleInterleavedZeroBubble", [1, 3, 5], 6)]
    assert [r["ZBV"] for r in ranks] == [("ScheduleZBVZeroBubble", [0, 3], 4), ("ScheduleZBVZeroBubble", [1, 2], 4)]
    assert [r["microbatches-6"] for r in ranks] == [("Schedule1F1B", [0], 6), ("Schedule1F1B", [1], 6)]

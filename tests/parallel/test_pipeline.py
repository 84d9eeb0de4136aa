"""Pipeline layout, option checks and micro-batch stacking (single process; the schedules
themselves run in tests/train/test_engine_pipeline.py)."""

from __future__ import annotations

import logging

import pytest
import torch

from tandem.errors import ConfigError
from tandem.parallel.config import ParallelizeConfig, check_pipeline_options, normalize_schedule
from tandem.parallel.pipeline import pad_row, resolve_layout, stack_packed, unpad_row


def test_schedule_names_short_and_any_case():
    assert normalize_schedule("I1F1B") == "Interleaved1F1B"
    assert normalize_schedule("izb") == "InterleavedZeroBubble"
    assert normalize_schedule("ZBV") == "ZBVZeroBubble"
    assert normalize_schedule("1f1b") == "1F1B"
    with pytest.raises(ConfigError, match=r"actor\.parallelize\.pp_schedule='GPipe' is unknown"):
        normalize_schedule("GPipe")


def test_stages_per_rank_follow_the_schedule():
    assert check_pipeline_options("1F1B", None) == ("1F1B", 1)
    assert check_pipeline_options("I1F1B", None) == ("Interleaved1F1B", 2)
    assert check_pipeline_options("IZB", 3) == ("InterleavedZeroBubble", 3)
    assert check_pipeline_options("ZBV", None) == ("ZBVZeroBubble", 2)
    for schedule, per_rank in (("1F1B", 2), ("I1F1B", 1), ("ZBV", 3), ("ZBV", 1)):
        with pytest.raises(ConfigError, match=r"actor.parallelize.pp_stages_per_rank="):
            check_pipeline_options(schedule, per_rank)
    with pytest.raises(ConfigError, match=r"actor\.parallelize\.pp_stages_per_rank=4: ZBVZeroBubble"):
        ParallelizeConfig(pp_schedule="ZBV", pp_stages_per_rank=4).check_pipeline("actor.parallelize.")
    with pytest.raises(ConfigError, match="does not work with compiled blocks"):
        ParallelizeConfig(pp_schedule="IZB", compile=True).check_pipeline()
    ParallelizeConfig(pp_schedule="I1F1B", compile=True).check_pipeline()
    assert check_pipeline_options("dualpipev", None) == ("DualPipeV", 2)
    with pytest.raises(ConfigError, match=r"actor\.parallelize\.pp_stages_per_rank=3: DualPipeV runs exactly 2"):
        check_pipeline_options("DualPipeV", 3)
    with pytest.raises(ConfigError, match="fewer than the 8 pipeline stages"):
        resolve_layout("I1F1B", 4, None, 6)


def test_loop_and_v_layouts():
    loop = resolve_layout("Interleaved1F1B", 2, None, 6)
    assert [loop.stage_rank(s) for s in range(4)] == [0, 1, 0, 1]
    assert loop.rank_stages(0) == [0, 2] and loop.rank_stages(1) == [1, 3]
    assert [loop.stage_layers(s) for s in range(4)] == [[0, 1], [2, 3], [4], [5]]
    v = resolve_layout("ZBV", 2, None, 4)
    assert [v.stage_rank(s) for s in range(4)] == [0, 1, 1, 0]
    assert v.rank_stages(0) == [0, 3]  # the first and the last stage on one rank
    one = resolve_layout("1F1B", 4, None, 4)
    assert [one.stage_layers(s) for s in range(4)] == [[0], [1], [2], [3]]
    assert [one.layer_stage(i) for i in range(4)] == [0, 1, 2, 3]


def test_microbatches_raised_to_stages_with_a_warning(caplog):
    layout = resolve_layout("I1F1B", 2, None, 4)
    assert layout.n_microbatches(None) == 4 and layout.n_microbatches(6) == 6
    with caplog.at_level(logging.WARNING):
        assert layout.n_microbatches(1) == 4
    assert "pp_microbatches=1 is below the 4 pipeline stages" in caplog.text


def test_stack_packed_pads_rows_and_unpad_restores_them():
    ids = [torch.tensor([1, 2, 3, 4, 5]), torch.tensor([6, 7])]
    cus = [torch.tensor([0, 2, 5], dtype=torch.int32), torch.tensor([0, 2], dtype=torch.int32)]
    stacked = stack_packed(ids, cus, [torch.tensor([0, 1, 1, 0, 1], dtype=torch.bool), None])
    assert stacked.input_ids.tolist() == [[1, 2, 3, 4, 5], [6, 7, 0, 0, 0]]
    assert stacked.cu_seqlens.tolist() == [[0, 2, 5], [0, 2, 2]]
    assert stacked.sizes.tolist() == [[5, 2], [2, 1]]
    assert stacked.wanted.tolist() == [[False, True, True, False, True], [True, True, False, False, False]]
    assert stack_packed(ids, cus, [None, None]).wanted is None
    cu, (row, want) = unpad_row(stacked.sizes[1:2], stacked.cu_seqlens[1:2], stacked.input_ids[1:2],
                                stacked.wanted[1:2])
    assert cu.tolist() == [0, 2] and row.tolist() == [6, 7] and want.tolist() == [True, True]
    hidden = torch.randn(2, 3)
    padded = pad_row(hidden, 5)
    assert padded.shape == (1, 5, 3) and torch.equal(padded[0, :2], hidden) and not padded[0, 2:].any()


@pytest.mark.parametrize("schedule", ["IZB", "ZBV", "DualPipeV"])
def test_zero_bubble_schedules_refuse_what_their_split_backward_cannot_run_with_the_reason(schedule):
    """The document's rules: the split into input and weight gradients runs on no compiled block
    and with no op-level selective or memory-budget checkpointing; full and layer-level
    checkpointing are fine (tests/train/test_engine_pipeline.py runs them against d1)."""
    split = "splits backward into input and weight gradients"
    for options, fix in (({"compile": True}, "compile=false"),
                         ({"activation_checkpoint": "selective", "ac_selective": "op"}, "ac_selective=layer"),
                         ({"activation_checkpoint": "memory_budget"}, "choose full or selective")):
        with pytest.raises(ConfigError, match=split) as info:
            ParallelizeConfig(pp_schedule=schedule, **options).check_pipeline("actor.parallelize.")
        assert fix in str(info.value)
    ParallelizeConfig(pp_schedule=schedule, activation_checkpoint="full").check_pipeline()
    ParallelizeConfig(pp_schedule=schedule, activation_checkpoint="selective", ac_every=2).check_pipeline()
    on_cuda, notes = ParallelizeConfig(pp_schedule=schedule).for_device("cuda", pp=2)
    assert (on_cuda.compile, on_cuda.activation_checkpoint) == (False, "full") and len(notes) == 2
    on_cuda.check_pipeline()

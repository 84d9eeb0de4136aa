"""Defaults by device (issue 44): compile and activation checkpointing left to the device are on
(compile, op-level selective) on CUDA and off on CPU; the attention kernel and deterministic mode
follow the device the same way."""

from __future__ import annotations

import logging

import pytest
import torch

from tandem.errors import ConfigError
from tandem.parallel.config import ParallelizeConfig
from tandem.train.config import TrainEngineConfig
from tandem.train.dist import seed_everything
from tandem.train.engine import TrainEngine
from tests.train.helpers import engine_config


def test_cpu_defaults_are_unchanged_and_cuda_gets_compile_and_op_level_selective_checkpointing():
    cpu, notes = ParallelizeConfig().for_device("cpu")
    assert (cpu.compile, cpu.activation_checkpoint, cpu.ac_selective, notes) == (False, "none", "layer", [])
    cuda, notes = ParallelizeConfig().for_device("cuda")
    assert (cuda.compile, cuda.activation_checkpoint, cuda.ac_selective, notes) == (True, "selective", "op", [])


def test_explicit_options_stay_as_set_on_every_device():
    chosen = ParallelizeConfig(compile=False, activation_checkpoint="full", ac_selective="layer")
    for device in ("cpu", "cuda"):
        resolved, notes = chosen.for_device(device, tp=2, pp=2)
        assert resolved == chosen and notes == []


def test_cuda_defaults_step_aside_for_what_a_layout_cannot_run():
    """Torch cannot compile checkpointed tensor-parallel blocks, and the zero-bubble schedules run
    no compiled blocks and no op-level selective checkpointing: the device's defaults give way
    there, and say why."""
    tp, notes = ParallelizeConfig().for_device("cuda", tp=2)
    assert (tp.compile, tp.activation_checkpoint) == (True, "none")
    assert notes == ["activation checkpointing off: compile with tensor parallelism (tp=2) cannot compile "
                     "checkpointed blocks"]
    tp.check_layout(2)  # what the defaults chose is a layout that runs
    zb, notes = ParallelizeConfig(pp_schedule="ZBV").for_device("cuda", pp=2)
    assert (zb.compile, zb.activation_checkpoint) == (False, "full")
    assert notes == ["compile off: pp_schedule=ZBV runs no compiled blocks",
                     "activation checkpointing full: pp_schedule=ZBV runs no op-level selective checkpointing"]
    zb.check_pipeline()
    plain_pp, _ = ParallelizeConfig(pp_schedule="ZBV").for_device("cuda", pp=1)  # no pipeline: no schedule
    assert plain_pp.compile is True
    chosen_ac, notes = ParallelizeConfig(activation_checkpoint="full").for_device("cuda", tp=2)
    assert (chosen_ac.compile, chosen_ac.activation_checkpoint) == (False, "full")
    assert notes == ["compile off: activation_checkpoint=full with tensor parallelism (tp=2) cannot be compiled"]
    chosen_ac.check_layout(2)


def test_memory_budget_takes_compile_from_the_device():
    budget = ParallelizeConfig(activation_checkpoint="memory_budget")
    budget.check()  # compile not chosen yet
    budget.for_device("cuda")[0].check()
    with pytest.raises(ConfigError, match=r"activation_checkpoint=memory_budget works through torch\.compile"):
        budget.for_device("cpu")[0].check()


def test_the_engine_runs_with_the_devices_choices_and_logs_them(tiny_dir, caplog):
    with caplog.at_level(logging.INFO, logger="tandem.train.engine"):
        engine = TrainEngine(engine_config(str(tiny_dir)))
    try:
        p = engine.config.parallelize
        assert (p.compile, p.activation_checkpoint) == (False, "none")
        assert engine.model.attention_kernel == "sdpa"
        assert "compile=False, activation_checkpoint=none, attention=sdpa" in caplog.text
    finally:
        engine.close()


@pytest.mark.parametrize(("attention", "device", "dtype", "error"), [
    ("varlen", "cpu", "bfloat16", "attention=varlen is flash attention's kernel: CUDA with dtype float16 or "
                                  r"bfloat16 only \(here cpu, bfloat16\); set attention=auto"),
    ("varlen", "cuda", "float32", r"\(here cuda, float32\)"),
    ("flex", "cpu", "float32", "attention=flex trains on CUDA only"),
])
def test_an_attention_kernel_the_device_cannot_train_with_is_refused(attention, device, dtype, error):
    with pytest.raises(ConfigError, match=error):
        TrainEngineConfig(attention=attention, dtype=dtype).check_attention(device)
    TrainEngineConfig(attention="auto", dtype=dtype).check_attention(device)


@pytest.mark.parametrize(("device", "warn_only"), [("cpu", False), ("cuda", True)])
def test_deterministic_mode_warns_on_cuda_and_fails_on_cpu(device, warn_only):
    """Archon's semantics on CUDA (`use_deterministic_algorithms(True, warn_only=True)`): an op
    without a deterministic kernel warns; on CPU it raises, as before."""
    before = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    try:
        seed_everything(1, True, device)
        assert torch.are_deterministic_algorithms_enabled()
        assert torch.is_deterministic_algorithms_warn_only_enabled() is warn_only
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])

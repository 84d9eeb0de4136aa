"""What a launch into a trial directory does, decided from the file system alone."""

from __future__ import annotations

import time

import pytest

from tandem.errors import ConfigError
from tandem.rl.checkpoints import LoopState, checkpoints_dir, latest_checkpoint, save_checkpoint
from tandem.rl.config import load_run_config
from tandem.rl.trial import plan_trial, relaunch_plan
from tandem.rollout.frontier import FrontierState


@pytest.fixture
def cfg(tmp_path):
    def make(*overrides: str):
        return load_run_config(None, [f"experiment.fileroot={tmp_path}", "experiment.name=e", "experiment.trial=t",
                                  "train.total_steps=10", *overrides])
    return make


def trial(tmp_path):
    return tmp_path / "e" / "t"


def checkpoint(run, step: int, next_index: int, resolved=(), keep: int = 10):
    """A checkpoint as `tandem train` writes one (its trainer part: one file)."""
    def trainer_part(directory):
        directory.mkdir(parents=True)
        (directory / "train_state.pt").write_bytes(b"x")
    return save_checkpoint(run, LoopState(step, FrontierState(next_index, tuple(resolved)), seed=1), trainer_part,
                           keep=keep)


def test_a_fresh_trial_starts_at_zero(tmp_path, cfg):
    plan = plan_trial(cfg())
    assert (plan.run_dir, plan.resume_from, plan.start_step, plan.replace) == (trial(tmp_path), None, 0, ())
    assert not trial(tmp_path).exists()  # deciding creates nothing
    plan.prepare()
    assert trial(tmp_path).is_dir()


def test_outputs_without_a_checkpoint_are_refused(tmp_path, cfg):
    (trial(tmp_path) / "logs").mkdir(parents=True)
    (trial(tmp_path) / "sft-metrics.jsonl").write_text("{}\n")  # `tandem sft`'s: not an RL output
    assert plan_trial(cfg()).start_step == 0
    (trial(tmp_path) / "metrics.jsonl").write_text('{"step": 1}\n')
    config = cfg()  # loading the config (OmegaConf: ~0.2 s) is not part of the decision timed below
    start = time.monotonic()
    with pytest.raises(ConfigError) as info:
        plan_trial(config)
    assert time.monotonic() - start < 1  # decided from the file system (< 1 ms quiet): no wait on anything
    msg = str(info.value)
    assert "already holds the outputs of an earlier run (metrics.jsonl)" in msg
    assert "train.overwrite=true" in msg and "experiment.trial=t-2" in msg


def test_the_latest_checkpoint_is_resumed(tmp_path, cfg):
    run = trial(tmp_path)
    two = checkpoint(run, 2, 8)
    four = checkpoint(run, 4, 16, resolved=(18, 19))
    (checkpoints_dir(run) / ".step00000006.partial-123" / "trainer").mkdir(parents=True)  # a save cut short
    (run / "metrics.jsonl").write_text('{"step": 5}\n')
    assert latest_checkpoint(run) == four and four.name == "step00000004"
    plan = plan_trial(cfg())
    assert (plan.resume_from, plan.start_step, plan.loop.frontier, plan.automatic) == (
        four, 4, FrontierState(16, (18, 19)), True)
    assert "resuming at step 4" in plan.describe()
    explicit = plan_trial(cfg(f"train.resume_from={two}"))
    assert (explicit.start_step, explicit.loop.frontier.next_index, explicit.automatic) == (2, 8, False)


def test_recover_modes(tmp_path, cfg):
    run = trial(tmp_path)
    with pytest.raises(ConfigError, match=r"recover.mode=resume: .* has no checkpoint"):
        plan_trial(cfg("recover.mode=resume"))
    assert plan_trial(cfg("recover.mode=off")).start_step == 0  # nothing to resume: starts
    checkpoint(run, 3, 12)
    assert plan_trial(cfg("recover.mode=resume")).start_step == 3
    with pytest.raises(ConfigError, match=r"recover.mode=off does not resume: pass train.overwrite=true"):
        plan_trial(cfg("recover.mode=off"))
    assert plan_trial(cfg("recover.mode=off", "train.overwrite=true")).start_step == 0


def test_a_relaunch_resumes_or_starts_again(tmp_path, cfg):
    run = trial(tmp_path)
    (run / "metrics.jsonl").parent.mkdir(parents=True)
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    fresh = relaunch_plan(cfg())  # failed before its first checkpoint: start again, replacing its outputs
    assert fresh.start_step == 0 and run / "metrics.jsonl" in fresh.replace
    checkpoint(run, 2, 8)
    assert relaunch_plan(cfg()).start_step == 2


def test_a_complete_trial_is_refused(tmp_path, cfg):
    checkpoint(trial(tmp_path), 10, 40)
    with pytest.raises(ConfigError, match=r"is complete: its latest checkpoint \(step00000010\) is at step 10 and "
                                          r"train.total_steps=10. Raise train.total_steps"):
        plan_trial(cfg())
    assert plan_trial(cfg("train.total_steps=12")).start_step == 10


def test_overwrite_replaces_rl_outputs_only(tmp_path, cfg):
    run = trial(tmp_path)
    checkpoint(run, 2, 8)
    for name in ("metrics.jsonl", "summary.txt", "sft-metrics.jsonl", "logs/rollout-0.log"):
        (run / name).parent.mkdir(parents=True, exist_ok=True)
        (run / name).write_text("x")
    (run / "tensorboard").mkdir()
    plan = plan_trial(cfg("train.overwrite=true"))
    assert plan.start_step == 0 and plan.resume_from is None
    plan.prepare()
    assert sorted(p.name for p in run.iterdir()) == ["logs", "sft-metrics.jsonl"]
    assert (run / "logs" / "rollout-0.log").read_text() == "x"


def test_overwrite_cannot_delete_the_checkpoint_it_resumes(tmp_path, cfg):
    two = checkpoint(trial(tmp_path), 2, 8)
    with pytest.raises(ConfigError, match=r"train.overwrite=true would delete the checkpoint that train.resume_from"):
        plan_trial(cfg("train.overwrite=true", f"train.resume_from={two}"))


def test_resume_from_a_directory_that_is_no_checkpoint(tmp_path, cfg):
    with pytest.raises(ConfigError, match=r"train.resume_from: .* has no loop_state.json"):
        plan_trial(cfg(f"train.resume_from={tmp_path}"))

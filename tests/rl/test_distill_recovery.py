"""On-policy distillation under recovery (issue 48: "works with ... recovery"): a `tandem train`
with `algo.name=distill` and a launched teacher is SIGKILLed as a whole process group during
rollout and during training, and run again each time; compared with the same run left alone it
trains the same prompts with bit-identical per-step loss, reverse KL to the teacher and final
weights. The teacher's logprobs travel with the trajectories, so an episode lost in the kill is
drawn again and scored again, and a deterministic teacher scores it the same."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
import torch

from tandem.models.tiny import init_model
from tests.rl.common import write_config
from tests.rl.test_recovery import STEPS, by_step, final_weights, latest, launch

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

BATCH_INVARIANT = ["--num-threads", "1", "--batch-invariant"]


def config(root: Path, model: Path, teacher: Path) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    return write_config(
        root, model, algo={"name": "distill"},
        actor={"backend": "archon:d1", "deterministic": True, "optimizer": {"lr": 3e-3}},
        rollout={"backend": "tandem:d1", "max_head_offpolicyness": 0, "seed_sampling": True,
                 "server_args": BATCH_INVARIANT},
        teacher={"path": str(teacher), "backend": "tandem:d1", "server_args": BATCH_INVARIANT},
        gen={"n_samples": 2, "max_new_tokens": 8},
        train={"total_steps": STEPS, "save_every": 1, "weight_sync": "distributed"})


def test_a_distillation_killed_and_rerun_is_bit_identical(model_dir, tmp_path):
    teacher = init_model(tmp_path / "teacher", preset="tiny", seed=5)
    reference = tmp_path / "reference"
    proc = launch(config(reference, model_dir, teacher))
    assert proc.returncode == 0, proc.stderr[-3000:]
    root = tmp_path / "killed"
    cfg = config(root, model_dir, teacher)
    for kill, saved_before in (("rollout@2", "step00000001"), ("train@3", "step00000002")):
        proc = launch(cfg, kill)
        assert proc.returncode == -signal.SIGKILL, (kill, proc.returncode, proc.stderr[-3000:])
        assert latest(root) == saved_before, kill
    proc = launch(cfg)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resuming at step 2" in proc.stderr
    got, want = by_step(root), by_step(reference)
    assert all(want[s]["distill/reverse_kl"] != 0.0 for s in want), "no distillation signal to reproduce"
    for step in range(1, STEPS + 1):
        assert got[step]["data/prompt_ids"] == want[step]["data/prompt_ids"], step
        for key in ("train/loss", "train/grad_norm", "distill/reverse_kl", "distill/teacher_logprob"):
            assert got[step][key] == want[step][key], (step, key)  # bit-identical (JSON keeps every bit)
    mine, theirs = final_weights(root, tmp_path), final_weights(reference, tmp_path)
    assert mine and mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)

"""`tandem train` with `algo.name=distill`: the student trains on a launched teacher fleet's
per-token logprobs, through the asynchronous loop, while one of two teacher servers is SIGKILLed."""

from __future__ import annotations

import math

import pytest

from tandem.models.tiny import init_model
from tests.rl.common import rl_rows, run_dir, train_killing_a_server, write_config

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def test_distillation_survives_a_dead_teacher_server(tmp_path, model_dir):
    """Student: the tiny model; teacher: another tiny model (seed 5), on two launched teacher
    servers. After step 2 teacher server 0 is SIGKILLed. The run ends normally after 8 steps,
    every trajectory scored (no episode lost; by step k the teacher scored at least k batches), and
    every step logs the teacher's statistics.

    That the student learns toward the teacher is test_distill_learns.py's, on the exact KL: the
    per-token estimate logged here, from 8 samples of 8 tokens a step, has a noise (about 0.02)
    larger than 8 steps' drift, and a suite run saw its last two steps above its first two."""
    teacher = init_model(tmp_path / "teacher", preset="tiny", seed=5)
    cfg = write_config(tmp_path, model_dir, algo={"name": "distill"},
                       actor={"backend": "archon:d1", "optimizer": {"lr": 3e-3}},
                       rollout={"backend": "tandem:d1", "consumer_batch_size": 4},
                       teacher={"path": str(teacher), "backend": "tandem:d2", "server_args": ["--num-threads", "1"]},
                       gen={"n_samples": 2, "max_new_tokens": 8}, train={"total_steps": 8})
    train_killing_a_server(tmp_path, cfg, "teacher-0.log", after_steps=2)
    rows = rl_rows(tmp_path)
    assert [r["step"] for r in rows] == list(range(1, 9))
    assert all(r["rollout/lost_total"] == 0 for r in rows)
    scored = [r["teacher/scored_total"] for r in rows]
    assert all(s >= 8 * r["step"] for s, r in zip(scored, rows, strict=True)), scored  # 4 episodes x 2 samples a step
    assert all(math.isfinite(r["distill/reverse_kl"]) and r["distill/teacher_logprob"] < 0 for r in rows), rows
    assert (run_dir(tmp_path) / "logs" / "teacher-0.log").is_file()

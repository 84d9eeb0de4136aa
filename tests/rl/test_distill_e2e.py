"""`tandem train` with `algo.name=distill`: the student learns toward a launched teacher fleet's
per-token logprobs, through the asynchronous loop, while one of two teacher servers is SIGKILLed."""

from __future__ import annotations

import pytest

from tandem.models.tiny import init_model
from tests.rl.common import rl_rows, run_dir, train_killing_a_server, write_config

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def test_distillation_lowers_the_reverse_kl_and_survives_a_dead_teacher_server(tmp_path, model_dir):
    """Student: the tiny model; teacher: another tiny model (seed 5), on two launched teacher
    servers. After step 2 teacher server 0 is SIGKILLed. The run ends normally after 8 steps,
    every trajectory scored (no episode lost; by step k the teacher scored at least k batches), and
    the per-token reverse KL to the teacher falls: the mean of the last two steps is below the
    first two."""
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
    kl = [r["distill/reverse_kl"] for r in rows]
    assert sum(kl[-2:]) < sum(kl[:2]), kl
    assert (run_dir(tmp_path) / "logs" / "teacher-0.log").is_file()

"""metrics.jsonl holds one row per step, also across a resume."""

from __future__ import annotations

from tandem.rl.metrics import MetricsLogger, read_metrics


def test_a_resume_drops_the_rows_it_redoes(tmp_path):
    first = MetricsLogger(tmp_path, tensorboard=False)
    for step in range(5):
        first.log(step, {"reward/mean": float(step)})
    first.close()
    with (tmp_path / "metrics.jsonl").open("a") as f:
        f.write('{"phase": "rl", "step": 5, "rew')  # cut short by a crash
    resumed = MetricsLogger(tmp_path, resume_step=2, tensorboard=False)
    assert resumed.has_step(2) and not resumed.has_step(3)
    for step in (3, 4):
        resumed.log(step, {"reward/mean": 10.0 + step})
    resumed.close()
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4]
    assert [r["reward/mean"] for r in rows] == [0.0, 1.0, 2.0, 13.0, 14.0]


def test_a_new_run_starts_the_file_anew(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"phase": "rl", "step": 7}\n')
    MetricsLogger(tmp_path, tensorboard=False).close()
    assert read_metrics(tmp_path / "metrics.jsonl") == []

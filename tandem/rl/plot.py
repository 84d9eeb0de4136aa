"""The picture of a run: reward, eval accuracy, train/inference mismatch and where time went."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only; no display on servers and CI
import matplotlib.pyplot as plt

from tandem.rl.metrics import read_metrics


def _series(rows: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    points = [(r["step"], r[key]) for r in rows if r.get(key) is not None]
    return [p[0] for p in points], [p[1] for p in points]


def plot_run(metrics_path: Path, out_path: Path, title: str = "") -> Path:
    rows = [r for r in read_metrics(metrics_path) if r.get("phase") == "rl"]
    fig, axes = plt.subplots(2, 2, figsize=(11, 7))
    ax = axes[0][0]
    ax.plot(*_series(rows, "reward/mean"), label="rollout reward")
    ax.set_title("reward (mean over the batch)")
    ax.set_xlabel("step")
    ax = axes[0][1]
    ax.plot(*_series(rows, "eval/accuracy"), marker="o", label="eval accuracy (greedy)")
    ax.set_ylim(0, 1)
    ax.set_title("eval accuracy")
    ax.set_xlabel("step")
    ax = axes[1][0]
    ax.plot(*_series(rows, "mismatch/mean"), label="mean |diff|")
    ax.plot(*_series(rows, "mismatch/max"), label="max |diff|")
    ax.set_yscale("symlog", linthresh=1e-7)
    ax.set_title("train/inference logprob mismatch")
    ax.set_xlabel("step")
    ax.legend()
    ax = axes[1][1]
    steps, gen = _series(rows, "time/generation")
    _, train = _series(rows, "time/train")
    _, sync = _series(rows, "time/sync")
    if steps and len(steps) == len(train) == len(sync):
        ax.stackplot(steps, gen, train, sync, labels=["waiting for rollouts", "training", "weight sync"])
        ax.legend(loc="upper left")
    ax.set_title("time per step (s)")
    ax.set_xlabel("step")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out_path, dpi=110)
    plt.close(fig)
    return out_path

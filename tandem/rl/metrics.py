"""Where a run's numbers go: `metrics.jsonl` (always), TensorBoard event files, W&B (optional).

`metrics.jsonl` holds one row per step. A run that resumes at step k keeps the rows up to k and
drops the later ones (the steps it will redo), so the file never holds a step twice; TensorBoard
purges its later events the same way.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any


class MetricsLogger:
    def __init__(self, run_dir: Path, *, filename: str = "metrics.jsonl", resume_step: int | None = None,
                 tensorboard: bool = True, tensorboard_dir: str = "tensorboard", wandb_project: str | None = None,
                 run_name: str = "", config: dict[str, Any] | None = None):
        """`resume_step`: continue an existing file after step `resume_step` (rows of later steps,
        which the resumed run redoes, are dropped); None starts the file anew, so a run repeated
        in the same directory never mixes its rows with an earlier one's. Event files go to
        `run_dir/tensorboard_dir`."""
        self.path = run_dir / filename
        kept = _rows_up_to(self.path, resume_step) if resume_step is not None else []
        _write_rows(self.path, kept)
        self._steps = {row["step"] for row in kept}
        self._file = self.path.open("a")
        self._tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            purge = None if resume_step is None else resume_step + 1
            self._tb = SummaryWriter(str(run_dir / tensorboard_dir), purge_step=purge)
        self._wandb = None
        if wandb_project:
            try:
                import wandb
            except ImportError as exc:  # a config asked for it: say how to get it
                raise RuntimeError("stats.wandb_project is set but wandb is not installed: pip install wandb") from exc
            self._wandb = wandb.init(project=wandb_project, name=run_name, config=config)

    def has_step(self, step: int) -> bool:
        """A row for `step` exists (written by this run, or kept from the run it resumes)."""
        return step in self._steps

    def log(self, step: int, values: dict[str, float], phase: str = "rl") -> None:
        row = {"phase": phase, "step": step, "time": time.time(), **{k: _num(v) for k, v in values.items()}}
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()
        self._steps.add(step)
        if self._tb is not None:
            for key, value in values.items():
                if isinstance(value, int | float) and math.isfinite(value):
                    self._tb.add_scalar(f"{phase}/{key}", value, step)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log({f"{phase}/{k}": v for k, v in values.items()}, step=step)

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


def _num(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None  # JSON has no NaN
    return value


def _rows_up_to(path: Path, step: int) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    return [row for row in read_metrics(path) if row.get("step", 0) <= step]


def _write_rows(path: Path, rows: list[dict[str, Any]]) -> None:
    """Replace the file atomically (a crash leaves the old file or the new one, never half)."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text("".join(json.dumps(row) + "\n" for row in rows))
    tmp.replace(path)


def read_metrics(path: Path) -> list[dict[str, Any]]:
    rows = []
    for line in path.read_text().splitlines():
        if line.strip():
            try:
                rows.append(json.loads(line))
            except ValueError:  # a line cut short by a crash mid-write
                continue
    return rows

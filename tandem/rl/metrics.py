"""Where a run's numbers go: `metrics.jsonl` (always), TensorBoard event files, and the
trackers `stats.*` asks for (W&B, MLflow: tandem.rl.trackers).

`metrics.jsonl` holds one row per step. A run that resumes at step k keeps the rows up to k and
drops the later ones (the steps it will redo), so the file never holds a step twice; TensorBoard
purges its later events the same way. TensorBoard and the trackers get each row's finite numbers
as `phase/key`.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tandem.rl.trackers import Tracker


class MetricsLogger:
    def __init__(self, run_dir: Path, *, filename: str = "metrics.jsonl", resume_step: int | None = None,
                 tensorboard: bool = True, tensorboard_dir: str = "tensorboard", trackers: Sequence[Tracker] = ()):
        """`resume_step`: continue an existing file after step `resume_step` (rows of later steps,
        which the resumed run redoes, are dropped); None starts the file anew, so a run repeated
        in the same directory never mixes its rows with an earlier one's. Event files go to
        `run_dir/tensorboard_dir`. `trackers` (started by `tandem.rl.trackers.start_trackers`)
        get every row, and are finished by `close`."""
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
        self._trackers = list(trackers)

    def has_step(self, step: int) -> bool:
        """A row for `step` exists (written by this run, or kept from the run it resumes)."""
        return step in self._steps

    def log(self, step: int, values: dict[str, float], phase: str = "rl") -> None:
        now = time.time()
        row = {"phase": phase, "step": step, "time": now, **{k: _num(v) for k, v in values.items()}}
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()
        self._steps.add(step)
        scalars = {f"{phase}/{k}": v for k, v in values.items() if isinstance(v, int | float) and math.isfinite(v)}
        if self._tb is not None:
            for key, value in scalars.items():
                self._tb.add_scalar(key, value, step)
            self._tb.flush()
        for tracker in self._trackers:
            tracker.log(step, scalars, now)

    def close(self, artifacts: Sequence[Path] = (), failed: bool = False) -> None:
        """Close the file and event files; hand the trackers `artifacts` (those that exist: the
        run's plot and summary) and end their runs, as failed when `failed`."""
        self._file.close()
        if self._tb is not None:
            self._tb.close()
        trackers, self._trackers = self._trackers, []
        for tracker in trackers:
            tracker.finish(artifacts, failed=failed)


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

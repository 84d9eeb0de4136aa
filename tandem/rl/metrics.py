"""Where a run's numbers go: `metrics.jsonl` (always), TensorBoard event files, W&B (optional)."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any


class MetricsLogger:
    def __init__(self, run_dir: Path, *, filename: str = "metrics.jsonl", append: bool = False,
                 tensorboard: bool = True, wandb_project: str | None = None, run_name: str = "",
                 config: dict[str, Any] | None = None):
        """`append` continues an existing file (a resumed run); otherwise the file starts empty, so
        a run repeated in the same directory never mixes its rows with the previous one's."""
        self.path = run_dir / filename
        self._file = self.path.open("a" if append else "w")
        self._tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(run_dir / "tensorboard"))
        self._wandb = None
        if wandb_project:
            try:
                import wandb
            except ImportError as exc:  # a config asked for it: say how to get it
                raise RuntimeError("stats.wandb_project is set but wandb is not installed: pip install wandb") from exc
            self._wandb = wandb.init(project=wandb_project, name=run_name, config=config)

    def log(self, step: int, values: dict[str, float], phase: str = "rl") -> None:
        row = {"phase": phase, "step": step, "time": time.time(), **{k: _num(v) for k, v in values.items()}}
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()
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


def read_metrics(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

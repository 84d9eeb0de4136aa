"""`RunStore`: a run directory read for the dashboard: `metrics.jsonl` and what `RunRecorder`
wrote under `dashboard/`. JSON-lines files are read incrementally (only what was appended since
the last read; from the start again when a resumed run rewrote one), so a page that polls a
running job, or opens a 1,000-step run, parses each row once. Any file may be absent (a run that
has not written it yet): it reads as empty."""

from __future__ import annotations

import gzip
import json
import os
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Any

from tandem.dashboard.record import DIRECTORY, KEY_FILE


class JsonLines:
    """An append-only JSON-lines file's rows, re-read from where the last read stopped."""

    def __init__(self, path: Path):
        self.path = path
        self.rows: list[dict[str, Any]] = []
        self._offset = 0
        self._inode: int | None = None

    def read(self) -> list[dict[str, Any]]:
        try:
            st = self.path.stat()
        except FileNotFoundError:
            self.rows, self._offset, self._inode = [], 0, None
            return self.rows
        if st.st_ino != self._inode or st.st_size < self._offset:  # replaced or rewritten (a resume)
            self.rows, self._offset, self._inode = [], 0, st.st_ino
        if st.st_size > self._offset:
            with self.path.open("rb") as f:
                f.seek(self._offset)
                data = f.read(st.st_size - self._offset)
            end = data.rfind(b"\n") + 1  # a line still being written waits for the next read
            self.rows.extend(json.loads(line) for line in data[:end].splitlines() if line.strip())
            self._offset += end
        return self.rows


class RunStore:
    def __init__(self, run_dir: str | Path, cached_steps: int = 64):
        self.run_dir = Path(run_dir)
        if not self.run_dir.is_dir():
            raise FileNotFoundError(f"{self.run_dir} is not a run directory (tandem train writes one per "
                                    "experiment.name/experiment.trial under experiment.fileroot)")
        self.root = self.run_dir / DIRECTORY
        self._metrics = JsonLines(self.run_dir / "metrics.jsonl")
        self._steps = JsonLines(self.root / "steps.jsonl")
        self._events = JsonLines(self.root / "fleet-events.jsonl")
        self._fleet_steps = JsonLines(self.root / "fleet-steps.jsonl")
        self._index = JsonLines(self.root / "trajectories" / "index.jsonl")
        self._lock = threading.Lock()  # the app's threads share the readers
        self._files: OrderedDict[tuple[int, int], list[dict[str, Any]]] = OrderedDict()
        self._cached_steps = cached_steps

    def key(self) -> str | None:
        """The page's key (`dashboard/key`), or None when the run wrote none (yet)."""
        try:
            return (self.root / KEY_FILE).read_text().strip() or None
        except FileNotFoundError:
            return None

    def run(self) -> dict[str, Any]:
        """The run's name, whether it is going (its controller file exists) and its summary."""
        summary = self.run_dir / "summary.txt"
        return {"name": "/".join(self.run_dir.parts[-2:]),
                "running": (self.run_dir / "controller.json").is_file(),
                "summary": summary.read_text() if summary.is_file() else None}

    def metrics(self, since: int = 0) -> tuple[list[dict[str, Any]], int]:
        """Rows of `metrics.jsonl` from row `since`; and the count of rows so far."""
        with self._lock:
            rows = self._metrics.read()
            return rows[since:], len(rows)

    def steps(self, since: int = 0) -> tuple[list[dict[str, Any]], int]:
        with self._lock:
            rows = self._steps.read()
            return rows[since:], len(rows)

    def fleet(self, events: int = 500) -> dict[str, Any]:
        """The fleet now (`fleet.json`), its last `events` changes (and how many there are), and
        its per-step rows."""
        try:
            now = json.loads((self.root / "fleet.json").read_text())
        except (FileNotFoundError, ValueError):
            now = {"servers": []}
        with self._lock:
            changes = self._events.read()
            now["events"], now["events_total"] = changes[-events:] if events else [], len(changes)
            now["steps"] = list(self._fleet_steps.read())
        return now

    def trajectories(self, *, step: int | None = None, min_reward: float | None = None,
                     max_reward: float | None = None, staleness: int | None = None, offset: int = 0,
                     limit: int = 100) -> dict[str, Any]:
        """Index rows of sampled trajectories that pass the filters (newest step first), a page of them."""
        with self._lock:
            rows = self._index.read()
            chosen = [r for r in reversed(rows)
                      if (step is None or r["step"] == step) and (min_reward is None or r["reward"] >= min_reward)
                      and (max_reward is None or r["reward"] <= max_reward)
                      and (staleness is None or r["staleness"] == staleness)]
        return {"total": len(chosen), "rows": chosen[offset:offset + limit]}

    def trajectory(self, step: int, i: int) -> dict[str, Any]:
        """Sampled trajectory `i` of step `step`; KeyError when there is none."""
        path = self.root / "trajectories" / f"step-{step:06d}.jsonl.gz"
        try:
            st = path.stat()
        except FileNotFoundError:
            raise KeyError(f"step {step} has no recorded trajectories") from None
        with self._lock:
            key = (step, st.st_mtime_ns)
            rows = self._files.get(key)
            if rows is None:
                with gzip.open(path, "rt") as f:
                    rows = [json.loads(line) for line in f if line.strip()]
                self._files[key] = rows
                while len(self._files) > self._cached_steps:
                    self._files.popitem(last=False)
            self._files.move_to_end(key)
        if not 0 <= i < len(rows):
            raise KeyError(f"step {step} has {len(rows)} recorded trajectories, not {i + 1}")
        return rows[i]

    def changed(self) -> tuple[Any, ...]:
        """A value that changes whenever a file the page shows does (sizes and modification times)."""
        out: list[Any] = []
        for path in (self.run_dir / "metrics.jsonl", self.root / "fleet.json", self.root / "steps.jsonl",
                     self.run_dir / "controller.json", self.run_dir / "summary.txt"):
            try:
                st = os.stat(path)
                out.append((st.st_size, st.st_mtime_ns))
            except FileNotFoundError:
                out.append(None)
        return tuple(out)

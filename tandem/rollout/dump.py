"""Trajectory dumps for debugging: one JSONL file per version, one trajectory per line (off by default)."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterable, Iterator
from pathlib import Path

from tandem.data.trajectory import Trajectory


class TrajectoryDumper:
    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()  # writers may be several threads (to_thread)

    def path(self, version: int) -> Path:
        return self.directory / f"v{version:06d}.jsonl"

    def write(self, version: int, trajs: Iterable[Trajectory]) -> None:
        lines = "".join(json.dumps(t.to_dict()) + "\n" for t in trajs)
        with self._lock, self.path(version).open("a") as f:
            f.write(lines)


def read_dump(path: str | Path) -> Iterator[Trajectory]:
    with Path(path).open() as f:
        for line in f:
            if line.strip():
                yield Trajectory.from_dict(json.loads(line))

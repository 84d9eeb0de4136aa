"""What one weight update reports (seconds, bytes, buckets, seconds per phase) or raises
(`WeightSyncError`), and the clocks it keeps while it runs."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from tandem.errors import TandemError
from tandem.fleet.results import FleetError, ServerResult


class WeightSyncError(TandemError, RuntimeError):
    """A weight update failed; `phase` says where, `failures` which servers said what."""

    def __init__(self, message: str, phase: str = "", failures: Sequence[ServerResult] = ()):
        super().__init__(message)
        self.phase, self.failures = phase, tuple(failures)

    @classmethod
    def from_fleet(cls, exc: FleetError) -> WeightSyncError:
        return cls(str(exc), exc.phase, exc.failures)


@dataclass
class UpdateReport:
    version: int
    type: str
    seconds: float = 0.0
    bytes: int = 0
    buckets: int = 0
    in_place: int = 0  # buckets the export gathered straight into their send memory (no pack copy)
    phases: dict[str, float] = field(default_factory=dict)  # rank 0: seconds per phase
    verified: bool = False
    servers: tuple[str, ...] = ()  # the servers that hold `version` now (every rank: rank 0's list)
    left_out: dict[str, str] = field(default_factory=dict)  # servers the update went on without, and why
    attempts: int = 0  # transfers started (more than 1: a server failed and the rest went again)
    warmed: tuple[str, ...] = ()  # joining servers warmed from disk and admitted

    @property
    def gb_per_s(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


class Clock:
    """The whole update's deadline: what is left of it, optionally capped by a phase's own."""

    def __init__(self, total_s: float):
        self.deadline = time.monotonic() + total_s

    def left(self, cap: float | None = None) -> float:
        left = max(0.0, self.deadline - time.monotonic())
        return left if cap is None else min(left, cap)


class timed:
    """`with timed(report, phase):` adds the block's seconds to `report.phases[phase]`."""

    def __init__(self, report: UpdateReport, phase: str):
        self.report, self.phase = report, phase

    def __enter__(self) -> None:
        self.start = time.perf_counter()

    def __exit__(self, *exc: object) -> None:
        self.report.phases[self.phase] = self.report.phases.get(self.phase, 0.0) + time.perf_counter() - self.start

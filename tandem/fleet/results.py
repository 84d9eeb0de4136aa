"""What a fleet call answers: one `ServerResult` per server, together a `FleetResult`; a call that
failed anywhere raises `FleetError` naming the phase and, per failing server, what it said."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from tandem.errors import TandemError


@dataclass(frozen=True)
class ServerChecksums:
    """sha256 per tensor (HF name) of one server's weights as served in `dtype`, and its version."""

    dtype: str
    checksums: dict[str, str]
    weight_version: int | None = None


@dataclass(frozen=True)
class ServerResult:
    """One server's outcome; `value` is the operation's answer type (None when it failed)."""

    address: str
    success: bool
    message: str = ""
    value: Any = None
    no_answer: bool = False  # it could not be reached or did not answer in time (vs answering an error)


@dataclass(frozen=True)
class FleetResult:
    """Per-server outcomes of one fleet call."""

    phase: str
    results: tuple[ServerResult, ...] = field(default_factory=tuple)

    @property
    def failures(self) -> tuple[ServerResult, ...]:
        return tuple(r for r in self.results if not r.success)

    def values(self) -> dict[str, Any]:
        """Address -> the server's answer, for the servers that succeeded."""
        return {r.address: r.value for r in self.results if r.success}

    def raise_for_failures(self) -> FleetResult:
        """Raise `FleetError` if any server failed (a call to no server at all is the sender's to
        refuse: the controller's fleet answers a version change with no member, for instance)."""
        if self.failures:
            raise FleetError(self.phase, self.failures, self.results)
        return self


class FleetError(TandemError, RuntimeError):
    """`failures`: the servers that failed; `results`: every server's outcome when known (the
    survivors' answers too, so a caller may go on with them)."""

    def __init__(self, phase: str, failures: Sequence[ServerResult], results: Sequence[ServerResult] = ()):
        self.phase = phase
        self.failures = tuple(failures)
        self.results = tuple(results) or self.failures
        detail = "; ".join(f"{f.address}: {f.message}" for f in self.failures) or "no server answered"
        super().__init__(f"fleet operation {phase!r} failed on {len(self.failures)} server(s): {detail}")

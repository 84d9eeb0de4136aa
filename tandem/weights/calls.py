"""Fleet calls as a weight update makes them: failures come back as values (`WeightSyncError`),
never as exceptions, so the update can always roll back and continue the servers; and one bucket
in flight (the servers' acknowledgement and the trainer's own part) with its deadline."""

from __future__ import annotations

import concurrent.futures as cf
import functools
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

from tandem.fleet.interface import MARGIN_S, Fleet
from tandem.fleet.ops import FleetOp
from tandem.fleet.results import FleetError
from tandem.weights.report import UpdateReport, WeightSyncError


def failure_of(phase: str, step: Callable[[], object], what: str | None = None) -> WeightSyncError | None:
    """Run `step` (fleet calls, checksum comparisons); the failure it raised, if any, as a value
    under `phase` (`what` names the step in the message; default: the phase)."""
    try:
        step()
    except FleetError as exc:
        return WeightSyncError.from_fleet(exc)
    except Exception as exc:  # a fleet that is not HTTP may raise anything
        return WeightSyncError(f"{what or phase} failed: {type(exc).__name__}: {exc}", phase)
    return None


def fleet_call(fleet: Fleet, op: FleetOp, request: object) -> WeightSyncError | None:
    """`op` on every server, waiting for all; the failure, if any."""
    return fleet_call_later(fleet, op, request)()


def fleet_call_later(fleet: Fleet, op: FleetOp, request: object) -> Callable[[], WeightSyncError | None]:
    """`op` on every server, sent now; the returned callable waits for all of them (the first time;
    later calls give the same answer) within the op's deadline: the failure, if any."""
    try:
        future = fleet.send(op, request)
    except Exception as exc:  # refused before it left (e.g. no server): answered when waited for
        future = Future()
        future.set_exception(exc)
    timeout = fleet.deadlines.seconds(op.deadline) + MARGIN_S

    @functools.cache
    def wait() -> WeightSyncError | None:
        return failure_of(op.name, lambda: future.result(timeout), f"fleet operation {op.name!r}")

    return wait


def wait_for(future: Future, phase: str, timeout: float) -> WeightSyncError | None:
    """Wait for a fleet future up to `timeout`; the failure, if any, under `phase` (which may
    say more than the operation's name, e.g. the bucket)."""
    try:
        future.result(timeout=timeout)
    except FleetError as exc:
        message = str(exc) if phase == exc.phase else f"{phase}: {exc}"
        return WeightSyncError(message, phase, exc.failures)
    except cf.TimeoutError:
        return WeightSyncError(f"fleet operation {phase!r}: no answer within {timeout:.1f}s", phase)
    except Exception as exc:
        return WeightSyncError(f"fleet operation {phase!r} failed: {type(exc).__name__}: {exc}", phase)
    return None


@dataclass
class InFlight:
    """One bucket on its way: the servers' acknowledgement and the trainer's own part (a broadcast
    on the transport's worker thread, returning its seconds), both due by `deadline`."""

    phase: str
    fleet_future: Future
    local_future: Future | None
    deadline: float

    def settle(self, report: UpdateReport, stuck: list[Future]) -> WeightSyncError | None:
        """Wait for both halves up to the deadline; a trainer part still running afterwards goes to
        `stuck` (a group must not be torn down under it). When the servers' half fails first (a
        member given up at its eviction spoils the bucket), the trainer's part is not waited for:
        it may be blocked on that member. -> the failure, if any."""
        problems: list[WeightSyncError] = []
        if self.local_future is not None:
            cf.wait([self.local_future, self.fleet_future], timeout=max(0.0, self.deadline - time.monotonic()),
                    return_when=cf.FIRST_EXCEPTION)
            fleet_failed = self.fleet_future.done() and self.fleet_future.exception() is not None
            if fleet_failed and not self.local_future.done():
                stuck.append(self.local_future)
                return wait_for(self.fleet_future, self.phase, 0.0)
            try:
                seconds = self.local_future.result(timeout=max(0.0, self.deadline - time.monotonic()))
                report.phases["broadcast"] = report.phases.get("broadcast", 0.0) + seconds
            except cf.TimeoutError:
                stuck.append(self.local_future)
                problems.append(WeightSyncError(f"{self.phase}: the trainer's side did not finish within the "
                                                "bucket deadline", self.phase))
            except Exception as exc:
                problems.append(WeightSyncError(f"{self.phase}: trainer side failed: {exc}", self.phase))
        failure = wait_for(self.fleet_future, self.phase, max(0.0, self.deadline - time.monotonic()) + 1.0)
        if failure is not None:
            problems.insert(0, failure)  # the servers' own words name who failed
        return problems[0] if problems else None

"""`FleetView`: the servers one weight update works with, which shrinks as servers fail.

A view sends every operation to its `targets` only. When it may `shrink` (an elastic fleet), an
operation that is not `collective` and fails on some targets but not all drops those (`dropped`
keeps what each said) and answers with the survivors' results. A collective operation, or a
failure on every target, raises `FleetError`; `blamed` names who to leave out of the next attempt.
See docs/fleet.md, "Elastic membership"."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from typing import Any

from tandem.fleet.adapters import Capabilities
from tandem.fleet.http import normalize_address
from tandem.fleet.interface import Fleet, Topology
from tandem.fleet.ops import Deadlines, FleetOp
from tandem.fleet.results import FleetError, FleetResult, ServerResult

logger = logging.getLogger(__name__)


class FleetView:
    def __init__(self, fleet: Fleet, targets: Sequence[str], shrink: bool = True,
                 devices: Mapping[str, int] | None = None):
        """`devices`: the targets' devices where more than one (`Topology.devices` of the fleet)."""
        self.fleet = fleet
        self.shrink = shrink
        self.targets = [normalize_address(a) for a in targets]
        self.devices = {normalize_address(a): n for a, n in (devices or {}).items()}
        self.dropped: dict[str, str] = {}  # address -> what it said when it was dropped

    @property
    def world_size(self) -> int:
        return self.topology().ranks(self.targets).world_size - 1

    @property
    def capabilities(self) -> Capabilities:
        return self.fleet.capabilities

    @property
    def deadlines(self) -> Deadlines:
        return self.fleet.deadlines

    def topology(self) -> Topology:
        return Topology(0, tuple(self.targets), devices={a: self.devices[a] for a in self.targets if a in self.devices})

    def admit(self, addresses: Sequence[str], version: int) -> None:
        self.fleet.admit(addresses, version)

    def send(self, op: FleetOp, request: Any, targets: Sequence[str] | None = None) -> Future[FleetResult]:
        chosen = list(self.targets) if targets is None else [normalize_address(a) for a in targets]
        if not chosen:
            raise FleetError(op.name, [])  # every target was dropped: nobody to send to
        inner = self.fleet.send(op, request, chosen)
        if op.collective or not self.shrink:
            return inner
        outer: Future[FleetResult] = Future()

        def settle(fut: Future[FleetResult]) -> None:
            exc = fut.exception()
            if exc is None:
                outer.set_result(fut.result())
                return
            survivors = tuple(r for r in exc.results if r.success) if isinstance(exc, FleetError) else ()
            if not survivors:
                outer.set_exception(exc)
                return
            for failure in exc.failures:
                self.drop(failure.address, f"{op.name}: {failure.message}")
            outer.set_result(FleetResult(op.name, survivors))

        inner.add_done_callback(settle)
        return outer

    def drop(self, address: str, why: str) -> None:
        """Leave `address` out of every later operation of this view."""
        address = normalize_address(address)
        if address in self.targets:
            self.targets.remove(address)
            self.dropped[address] = why
            logger.warning("weight update goes on without %s (%s)", address, why)


def blamed(failures: Sequence[ServerResult], targets: Sequence[str]) -> list[str]:
    """The targets to leave out after a failed collective operation: those that could not be
    reached or did not answer; failing that, the ones that failed when others did not (a group
    broken by a dead peer fails everywhere, and the dead one is the one that did not answer)."""
    failed = [f for f in failures if f.address in targets]
    silent = [f.address for f in failed if f.no_answer]
    if silent:
        return silent
    if failed and len(failed) < len(targets):
        return [f.address for f in failed]
    return []

"""The `Fleet` interface: every inference server at once, as trainer rank 0 and the controller see it.

One method carries every operation: `send(op, request)` sends `op` (from `tandem.fleet.ops.OPS`)
to every server and returns a future of the `FleetResult`, which raises `FleetError` (naming the
phase and each failing server) unless every server succeeded. `call` is the blocking form. The
direct `HttpFleet`, the controller (`RolloutController`) and the trainer-side `RolloutCallback`
implement it, so trainer code never learns who answers.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Protocol, TypeVar

from tandem.fleet.adapters import Capabilities
from tandem.fleet.ops import Deadlines, FleetOp
from tandem.fleet.results import FleetResult

Req = TypeVar("Req")

# Seconds a blocking caller waits beyond an operation's own deadline, so the per-server timeout
# (which names the server) fires first.
MARGIN_S = 10.0


class Fleet(Protocol):
    @property
    def world_size(self) -> int:
        """Ranks the servers occupy in a transfer group (one per server today)."""
        ...

    @property
    def capabilities(self) -> Capabilities: ...

    @property
    def deadlines(self) -> Deadlines: ...

    def send(self, op: FleetOp[Req, object], request: Req) -> Future[FleetResult]: ...


def call(fleet: Fleet, op: FleetOp[Req, object], request: Req) -> FleetResult:
    """`op` on every server, waiting for all of them; raises `FleetError` unless all succeeded."""
    return fleet.send(op, request).result(fleet.deadlines.seconds(op.deadline) + MARGIN_S)

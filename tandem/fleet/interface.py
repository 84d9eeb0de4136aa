"""The `Fleet` interface: the inference servers, as trainer rank 0 and the controller see them.

One method carries every operation: `send(op, request, targets)` sends `op` (from
`tandem.fleet.ops.OPS`) to each of `targets` (default: the fleet's members) and returns a future
of the `FleetResult`, which raises `FleetError` (naming the phase and each failing server) unless
every target succeeded. `call` is the blocking form. `topology()` says which servers a weight
update works with (`Topology`), and `admit` tells the fleet that warmed servers hold a version and
are in the update group. The direct `HttpFleet`, the controller (`RolloutController`) and the
trainer-side `RolloutCallback` implement it, so trainer code never learns who answers.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

from tandem.fleet.adapters import Capabilities
from tandem.fleet.ops import Deadlines, FleetOp
from tandem.fleet.ranks import GroupRanks, group_ranks
from tandem.fleet.results import FleetResult

Req = TypeVar("Req")

# Seconds a blocking caller waits beyond an operation's own deadline, so the per-server timeout
# (which names the server) fires first.
MARGIN_S = 10.0


@dataclass(frozen=True)
class Topology:
    """The servers a weight update works with, as the fleet's owner decided at one moment.

    `members`: the servers in the update group (healthy, or suspect but not yet evicted), in a
    stable order (a transfer group gives their devices ranks in this order, `tandem.fleet.ranks`).
    `warming`: servers that answer but do not hold the current weights yet, due to be warmed from
    disk and admitted at this update. `generation` grows whenever `members` changes. `elastic`:
    the fleet's owner evicts any member an update leaves out (so it never serves stale weights),
    which lets an update go on without servers that fail; a fixed fleet is not elastic, and an
    update fails with them. `devices`: the devices (transfer-group ranks) of each server named in
    `members` or `warming` that has more than one; `devices_of` reads it."""

    generation: int
    members: tuple[str, ...]
    warming: tuple[str, ...] = ()
    elastic: bool = False
    devices: dict[str, int] = field(default_factory=dict)

    def devices_of(self, address: str) -> int:
        return self.devices.get(address, 1)

    def ranks(self, servers: Sequence[str]) -> GroupRanks:
        """The transfer group of `servers`, in this order."""
        return group_ranks([self.devices_of(a) for a in servers])


class Fleet(Protocol):
    @property
    def world_size(self) -> int:
        """Ranks the members occupy in a transfer group: their devices (`Topology.devices`)."""
        ...

    @property
    def capabilities(self) -> Capabilities: ...

    @property
    def deadlines(self) -> Deadlines: ...

    def send(self, op: FleetOp[Req, object], request: Req,
             targets: Sequence[str] | None = None) -> Future[FleetResult]: ...

    def topology(self) -> Topology: ...

    def admit(self, addresses: Sequence[str], version: int) -> None:
        """`addresses` were warmed to `version` and joined the update group: they may serve."""
        ...


def call(fleet: Fleet, op: FleetOp[Req, object], request: Req, targets: Sequence[str] | None = None) -> FleetResult:
    """`op` on every target, waiting for all of them; raises `FleetError` unless all succeeded."""
    return fleet.send(op, request, targets).result(fleet.deadlines.seconds(op.deadline) + MARGIN_S)

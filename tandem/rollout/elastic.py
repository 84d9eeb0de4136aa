"""`ElasticFleet`: the controller's `Fleet`, over a membership that changes while the run goes on.

It owns the `Membership`, the `HealthMonitor` and the `HttpFleet` that carries the operations; the
healthy set goes to the `ServerPool` and to every `watch`er. `send(op, request, targets)` goes to
`targets`, by default the members; a server that fails an operation that is not collective is
evicted, and a successful `set_version` evicts every member it did not reach (it would serve stale
weights). An eviction gives up every call in flight to that server at once (the weight update's
as well as the rollouts'), and a call sent to a server already evicted is given up as it leaves:
nothing waits out a deadline for a server the membership knows is lost. `topology()` / `admit()` serve weight updates, `join(address, pid)` registers a server,
and `ready` holds rollouts back while fewer than `min_servers` are healthy (`on_too_small` is told
once after `min_servers_grace_s`). See docs/fleet.md, "Elastic membership"."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

from tandem.fleet import ops
from tandem.fleet.adapters import Capabilities, ServerAdapter
from tandem.fleet.http import HttpFleet, normalize_address
from tandem.fleet.interface import Topology
from tandem.fleet.ops import Deadlines, FleetOp, announces_version
from tandem.fleet.results import FleetError, FleetResult
from tandem.rollout.errors import RolloutError
from tandem.rollout.health import HealthConfig, HealthMonitor
from tandem.rollout.membership import Membership, MembershipConfig, MemberState
from tandem.rollout.pool import ServerPool

logger = logging.getLogger(__name__)


class FleetTooSmall(RolloutError):
    """Fewer than `rollout.min_servers` servers were healthy for `rollout.min_servers_grace_s`."""


class ElasticFleet:
    def __init__(self, addresses: Sequence[str], pool: ServerPool, adapter: ServerAdapter, *,
                 health: HealthConfig, min_servers: int, min_servers_grace_s: float, topology_cooldown_s: float,
                 deadlines: Deadlines, api_key: str | None = None, devices: int = 1,
                 clock: Callable[[], float] = time.monotonic, section: str = "rollout"):
        """`devices`: those of each server in `addresses` (joiners say their own); `section`: the
        config section whose `min_servers` keys the messages name (rollout, teacher)."""
        self.section = section
        self.adapter = adapter
        self.pool = pool
        self.min_servers = min_servers
        self.min_servers_grace_s = min_servers_grace_s
        self._deadlines = deadlines
        self._clock = clock
        self.membership = Membership(addresses, MembershipConfig(health.failure_threshold, topology_cooldown_s),
                                     clock=clock, devices=devices)
        self.monitor = HealthMonitor(self.membership, health, api_key=api_key, on_round=self.check_size)
        self.http = HttpFleet([normalize_address(a) for a in addresses], adapter=adapter, api_key=api_key,
                              deadlines=deadlines)
        self._lock = threading.Lock()
        self._short_since: float | None = None  # when the healthy count fell under min_servers
        self._too_small: Callable[[FleetTooSmall], None] | None = None
        self._ready = threading.Event()
        self._ready_watchers: list[Callable[[bool], None]] = []
        self.membership.watch(self._on_routable)
        self.membership.watch_evictions(self._on_evicted)

    # -- lifecycle ------------------------------------------------------------------------------
    def start(self, on_too_small: Callable[[FleetTooSmall], None]) -> None:
        self._too_small = on_too_small
        self.monitor.start()

    def close(self) -> None:
        self.monitor.stop()
        self.http.close()

    # -- Fleet ----------------------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        topology = self.membership.topology()
        return topology.ranks(topology.members).world_size - 1

    @property
    def capabilities(self) -> Capabilities:
        return self.adapter.capabilities

    @property
    def deadlines(self) -> Deadlines:
        return self._deadlines

    def topology(self) -> Topology:
        return self.membership.topology()

    def admit(self, addresses: Sequence[str], version: int) -> None:
        admitted = self.membership.admit([normalize_address(a) for a in addresses], version)
        if admitted:
            logger.info("admitted %s at version %d", ", ".join(admitted), version)

    def send(self, op: FleetOp, request: Any, targets: Sequence[str] | None = None) -> Future[FleetResult]:
        chosen = list(self.membership.topology().members if targets is None else targets)
        if not chosen:  # nobody to ask: only a version change means something (servers joining later get it)
            empty: Future[FleetResult] = Future()
            if op is ops.SET_VERSION:
                self.membership.set_version(request.version)
                empty.set_result(FleetResult(op.name, ()))
            else:
                empty.set_exception(FleetError(op.name, []))
            return empty
        inner = self.http.send(op, request, chosen)
        for address in chosen:  # evicted before the send counted it: give it up now
            record = self.membership.record(address)
            if record is not None and record.state is MemberState.EVICTED:
                self.http.abandon(record.address, f"evicted: {record.last_error}")
        inner.add_done_callback(lambda fut: self._on_result(op, request, fut))
        return inner

    # -- joins and the view for `tandem fleet` --------------------------------------------------
    def join(self, address: str, pid: int | None, listed: bool = False, devices: int = 1) -> str:
        record = self.membership.register(normalize_address(address), pid, listed=listed, devices=devices)
        logger.info("%s (pid %s) asked to join; it is %s", record.address, pid, record.state.value)
        return record.state.value

    def members(self) -> dict[str, Any]:
        load = {s.address: s for s in self.pool.snapshot()}
        servers = []
        for r in self.membership.snapshot():
            pooled = load.get(r.address)
            servers.append({
                "address": r.address, "pid": r.pid, "state": r.state.value, "version": r.version,
                "in_flight": pooled.outstanding if pooled else 0, "tokens_served": pooled.tokens if pooled else 0,
                "last_error": r.last_error,
            })
        return {"generation": self.membership.generation, "version": self.membership.current_version,
                "servers": servers}

    def stats(self) -> dict[str, float]:
        return {
            "fleet/healthy": float(self.membership.healthy_count()),
            "fleet/evicted_total": float(self.membership.evicted_total),
            "fleet/joined_total": float(self.membership.joined_total),
            "fleet/generation": float(self.membership.generation),
        }

    def evict(self, address: str, reason: str) -> None:
        """Take `address` out (the launcher saw it exit, for instance)."""
        self.membership.evict(normalize_address(address), reason)

    # -- readiness --------------------------------------------------------------------------------
    @property
    def ready(self) -> bool:
        """At least `min_servers` servers are healthy (at the current version)."""
        return self._ready.is_set()

    def watch_ready(self, callback: Callable[[bool], None]) -> None:
        with self._lock:
            self._ready_watchers.append(callback)
        callback(self.ready)

    def check_size(self) -> None:
        """Tell `on_too_small` once the fleet stayed under `min_servers` for the grace period
        (the health monitor calls it after each round)."""
        with self._lock:
            since, callback = self._short_since, self._too_small
            if since is None or callback is None or self._clock() - since < self.min_servers_grace_s:
                return
            self._too_small = None
        healthy = self.membership.healthy_count()
        errors = "; ".join(f"{r.address}: {r.state.value} ({r.last_error or 'no error'})"
                           for r in self.membership.snapshot() if r.state is not MemberState.HEALTHY)
        callback(FleetTooSmall(
            f"only {healthy} {self.section} server(s) healthy, fewer than {self.section}.min_servers="
            f"{self.min_servers}, for {self.min_servers_grace_s:g}s ({self.section}.min_servers_grace_s); {errors}. "
            + ("Start servers that can join (tandem serve --join RUN_DIR) or look" if self.section == "rollout"
               else "Look") + " at the servers' logs"))

    # -- internals --------------------------------------------------------------------------------
    def _on_routable(self, addresses: list[str]) -> None:
        self.pool.set_routable(addresses)
        ready = len(addresses) >= self.min_servers
        with self._lock:
            was = self._ready.is_set()
            if ready:
                self._ready.set()
                self._short_since = None
            else:
                self._ready.clear()
                if self._short_since is None:
                    self._short_since = self._clock()
            watchers = list(self._ready_watchers) if ready != was else []
        for callback in watchers:
            callback(ready)

    def _on_evicted(self, address: str) -> None:
        record = self.membership.record(address)
        self.http.abandon(address, f"evicted: {record.last_error if record is not None else 'no reason'}")
        if abandoned := self.pool.abandon(address):
            logger.info("%s: %d call(s) in flight given up; their requests go on elsewhere", address, abandoned)

    def _on_result(self, op: FleetOp, request: Any, fut: Future[FleetResult]) -> None:
        exc = fut.exception()
        if exc is None and announces_version(op, request):
            self.membership.set_version(request.version)
            reached = {r.address for r in fut.result().results}
            for address in self.membership.topology().members:
                if address not in reached:
                    self.membership.evict(address, f"left out of the update to version {request.version}: "
                                                   "its weights are stale")
        if not isinstance(exc, FleetError) or op.collective:
            return
        for failure in exc.failures:
            if failure.no_answer or op.marks_unhealthy:
                self.membership.evict(failure.address, f"{op.name} failed: {failure.message}")

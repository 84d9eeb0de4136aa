"""`Membership`: which inference servers the run has, and what each may do (control plane, no I/O).

The controller owns one. Each server is joining, warming, healthy, suspect or evicted (the states,
their transitions on `probe_ok` / `probe_failed`, `evict` and `admit`: docs/fleet.md, "Elastic
membership"). `topology()` is what a weight update works with: the members (healthy and suspect,
in arrival order) and the warming servers due now, additions held back by `topology_cooldown_s`
(longer for servers evicted before), removals at once. `generation` grows with every change of the
members; `watch` is told the healthy list when it changes and `watch_evictions` each evicted
address, after it (both outside the lock)."""

from __future__ import annotations

import dataclasses
import enum
import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from tandem.fleet.http import normalize_address
from tandem.fleet.interface import Topology

logger = logging.getLogger(__name__)


MAX_PENALTY = 8  # a server evicted again and again waits at most this many cooldowns to come back


def _penalty(evictions: int) -> int:
    """Cooldowns an evicted server waits (since its eviction) before it is admitted again: 1, 2, 4, 8."""
    return 0 if evictions <= 0 else min(2 ** (evictions - 1), MAX_PENALTY)


class MemberState(enum.Enum):
    JOINING = "joining"
    WARMING = "warming"
    HEALTHY = "healthy"
    SUSPECT = "suspect"
    EVICTED = "evicted"


_MEMBER_STATES = (MemberState.HEALTHY, MemberState.SUSPECT)


@dataclass
class ServerRecord:
    address: str
    state: MemberState
    pid: int | None = None
    version: int | None = None  # the weight version it holds, as far as the controller knows
    failures: int = 0  # failed probes in a row
    last_error: str = ""
    since: float = 0.0  # clock() at the last change of state
    listed: bool = False  # configured or launched by the run: probed while evicted, so its revival is seen
    evictions: int = 0  # times it was evicted: each doubles the wait before it is admitted again
    evicted_at: float = float("-inf")
    devices: int = 1  # its ranks in a transfer group (`tandem.fleet.ranks`)


@dataclass(frozen=True)
class MembershipConfig:
    failure_threshold: int = 3
    topology_cooldown_s: float = 30.0


class Membership:
    def __init__(self, addresses: Iterable[str], config: MembershipConfig = MembershipConfig(),
                 clock: Callable[[], float] = time.monotonic, devices: int = 1):
        """`devices`: those of each server in `addresses` (the rollout allocation's per server)."""
        self.config = config
        self._clock = clock
        self._lock = threading.Lock()
        now = clock()
        self._records: dict[str, ServerRecord] = {}
        for a in addresses:
            a = normalize_address(a)
            self._records.setdefault(a, ServerRecord(a, MemberState.HEALTHY, version=0, since=now, listed=True,
                                                     devices=devices))
        self._generation = 0
        self._members_dirty = False
        self._members_changed = float("-inf")  # clock() of the last change of the members
        self._version = 0
        self._evicted = 0
        self._joined = 0
        self._watchers: list[Callable[[list[str]], None]] = []
        self._eviction_watchers: list[Callable[[str], None]] = []
        self._evicted_untold: list[str] = []  # evictions the eviction watchers have not heard of yet
        self._routable = self._healthy()
        self._healthy_dirty = False  # a server entered or left HEALTHY since `_routable` was computed

    # -- reading ----------------------------------------------------------------------------------
    @property
    def current_version(self) -> int:
        return self._version

    @property
    def generation(self) -> int:
        return self._generation

    @property
    def evicted_total(self) -> int:
        return self._evicted

    @property
    def joined_total(self) -> int:
        return self._joined

    def now(self) -> float:
        """The membership's clock: what `probe_ok`'s `sent_at` is read on."""
        return self._clock()

    def snapshot(self) -> list[ServerRecord]:
        with self._lock:
            return [dataclasses.replace(r) for r in self._records.values()]

    def record(self, address: str) -> ServerRecord | None:
        with self._lock:
            r = self._records.get(normalize_address(address))
            return None if r is None else dataclasses.replace(r)

    def routable(self) -> list[str]:
        with self._lock:
            return self._healthy()

    def healthy_count(self) -> int:
        with self._lock:
            return len(self._healthy())

    def probe_targets(self) -> list[str]:
        """Every server but the evicted ones nobody listed (those come back only by joining)."""
        with self._lock:
            return [r.address for r in self._records.values() if r.state is not MemberState.EVICTED or r.listed]

    def topology(self) -> Topology:
        with self._lock:
            members = tuple(r.address for r in self._records.values() if r.state in _MEMBER_STATES)
            now, cooldown = self._clock(), self.config.topology_cooldown_s
            warming = [r for r in self._records.values()
                       if r.state is MemberState.WARMING and now >= r.evicted_at + _penalty(r.evictions) * cooldown]
            due = ()
            if warming and now >= max(min(r.since for r in warming), self._members_changed) + cooldown:
                due = tuple(r.address for r in warming)
            devices = {r.address: r.devices for r in self._records.values()
                       if r.devices != 1 and (r.address in members or r.address in due)}
            return Topology(self._generation, members, due, elastic=True, devices=devices)

    # -- changes ------------------------------------------------------------------------------------
    def watch(self, callback: Callable[[list[str]], None]) -> None:
        """`callback(healthy addresses)` now and whenever that list changes."""
        with self._lock:
            self._watchers.append(callback)
            current = list(self._routable)
        callback(current)

    def watch_evictions(self, callback: Callable[[str], None]) -> None:
        """`callback(address)` whenever a server is evicted (the pool gives up its calls in flight)."""
        with self._lock:
            self._eviction_watchers.append(callback)

    def set_version(self, version: int) -> None:
        """The members acknowledged `version` (a weight update)."""
        with self._lock:
            self._version = version
            for r in self._records.values():
                if r.state in _MEMBER_STATES:
                    r.version = version

    def set_pid(self, address: str, pid: int | None) -> None:
        with self._lock:
            r = self._records.get(normalize_address(address))
            if r is not None:
                r.pid = pid

    def probe_ok(self, address: str, version: int | None, sent_at: float | None = None) -> None:
        """`address` answered a probe sent at `sent_at` (`now()` then; None: just now). An answer to
        a probe sent before the server's last eviction says nothing of it since: it revives no one."""
        self._change(address, lambda r: self._on_ok(r, version, sent_at))

    def probe_failed(self, address: str, error: str) -> None:
        self._change(address, lambda r: self._on_failed(r, error))

    def evict(self, address: str, reason: str) -> bool:
        """Take `address` out at once; False when it is unknown or out already."""
        out: list[bool] = []

        def apply(r: ServerRecord) -> None:
            out.append(r.state is not MemberState.EVICTED)
            if out[0]:
                self._evict(r, reason)

        self._change(address, apply)
        return bool(out and out[0])

    def register(self, address: str, pid: int | None = None, listed: bool = False, devices: int = 1) -> ServerRecord:
        """A server asks to join: new or evicted ones start joining (with `devices`, the ranks it
        occupies in a transfer group); others stay as they are. `listed`: the run launched it (a
        replacement), so it is probed while evicted like the servers listed at the start."""
        if devices < 1:
            raise ValueError(f"a server has at least one device, not {devices}")
        address = normalize_address(address)
        with self._lock:
            r = self._records.get(address)
            if r is None:
                r = self._records[address] = ServerRecord(address, MemberState.JOINING, since=self._clock(),
                                                          devices=devices)
            elif r.state is MemberState.EVICTED:
                self._set(r, MemberState.JOINING)
                r.failures, r.version, r.devices = 0, None, devices
            if pid is not None:
                r.pid = pid
            r.listed = r.listed or listed
            self._commit_members()
            return dataclasses.replace(r)

    def admit(self, addresses: Iterable[str], version: int) -> list[str]:
        """Warmed servers that hold `version` and joined the update group: they may serve."""
        admitted = []
        with self._lock:
            for a in addresses:
                r = self._records.get(normalize_address(a))
                if r is not None and r.state is MemberState.WARMING:
                    self._set(r, MemberState.HEALTHY)
                    r.version, r.failures, r.last_error = version, 0, ""
                    admitted.append(r.address)
            self._joined += len(admitted)
            self._commit_members()
        self._notify()
        for a in admitted:
            logger.info("%s joined the fleet at version %d", a, version)
        return admitted

    # -- internals ----------------------------------------------------------------------------------
    def _change(self, address: str, apply: Callable[[ServerRecord], None]) -> None:
        with self._lock:
            r = self._records.get(normalize_address(address))
            if r is None:
                return
            apply(r)
            self._commit_members()
        self._notify()

    def _on_ok(self, r: ServerRecord, version: int | None, sent_at: float | None) -> None:  # under the lock
        if r.state is MemberState.JOINING:
            self._set(r, MemberState.WARMING)
            logger.info("%s answers; warming up", r.address)
        elif r.state is MemberState.SUSPECT:
            if version is not None and version != self._version:
                self._evict(r, f"answered again at version {version} while the fleet is at {self._version}: "
                               "it rejoins through warm-up")
                return
            self._set(r, MemberState.HEALTHY)
        elif r.state is MemberState.EVICTED:
            if not r.listed or (sent_at is not None and sent_at <= r.evicted_at):
                return
            self._set(r, MemberState.JOINING)  # revived: the join path, never straight back
            logger.info("%s answers again after its eviction; it rejoins", r.address)
            r.version = None
        if version is not None and r.state is not MemberState.JOINING:
            r.version = version
        r.failures = 0

    def _on_failed(self, r: ServerRecord, error: str) -> None:  # under the lock
        if r.state is MemberState.EVICTED:
            return  # it stays out; its last error stays the reason it was evicted
        r.last_error = error
        r.failures += 1
        if r.state is MemberState.HEALTHY:
            self._set(r, MemberState.SUSPECT)
        if r.state in (MemberState.SUSPECT, MemberState.WARMING) and r.failures >= self.config.failure_threshold:
            self._evict(r, f"{r.failures} probes failed in a row; the last: {error}")

    def _evict(self, r: ServerRecord, reason: str) -> None:  # under the lock
        self._set(r, MemberState.EVICTED)
        r.last_error, r.evictions, r.evicted_at = reason, r.evictions + 1, r.since
        self._evicted += 1
        self._evicted_untold.append(r.address)
        logger.warning("%s evicted: %s", r.address, reason)

    def _set(self, r: ServerRecord, state: MemberState) -> None:  # under the lock
        was_member, now_member = r.state in _MEMBER_STATES, state in _MEMBER_STATES
        self._healthy_dirty |= (r.state is MemberState.HEALTHY) != (state is MemberState.HEALTHY)
        r.state, r.since = state, self._clock()
        self._members_dirty |= was_member != now_member

    def _commit_members(self) -> None:  # under the lock, once per operation: one generation per change
        if self._members_dirty:
            self._members_dirty = False
            self._generation += 1
            self._members_changed = self._clock()

    def _healthy(self) -> list[str]:  # under the lock
        return [r.address for r in self._records.values() if r.state is MemberState.HEALTHY]

    def _notify(self) -> None:
        with self._lock:
            # Recomputed only after a state change in or out of HEALTHY: a probe that changes
            # nothing (nearly all of them) costs O(1), not a scan of the fleet.
            current, changed = self._routable, False
            if self._healthy_dirty:
                self._healthy_dirty = False
                current = self._healthy()
                changed, self._routable = current != self._routable, current
            watchers = list(self._watchers) if changed else []
            evicted, self._evicted_untold = self._evicted_untold, []
            eviction_watchers = list(self._eviction_watchers) if evicted else []
        for callback in watchers:
            callback(current)
        for address in evicted:
            for told in eviction_watchers:
                told(address)

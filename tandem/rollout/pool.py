"""A pool of inference servers: routing, outstanding-request counts, tokens served, health marks.

Only the servers the membership made routable (`set_routable`) are chosen: a rid goes back to its
server while that one is healthy, else the healthy server with the fewest outstanding requests
wins. Health here is what requests observe between probes; when every routable server is marked
unhealthy the pool still routes, and with none routable `choose` raises `NoServerError`.
`abandon(address)` gives up the calls leased on an evicted server. Thread-safe (one lock, never
held across I/O). See docs/rollout.md, "The inference client".

Choosing costs O(log N) in the fleet's size, not a scan: a heap holds each routable server's
(outstanding, served, address) as of its last change, entries of older changes are skipped as they
surface, and the heap is rebuilt when they make up most of it."""

from __future__ import annotations

import heapq
import itertools
import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from tandem.fleet.http import normalize_address
from tandem.rollout.errors import NoServerError


@dataclass
class PooledServer:
    address: str
    outstanding: int = 0
    served: int = 0
    healthy: bool = True
    consecutive_errors: int = 0
    routable: bool = True  # the membership lets it serve
    tokens: int = 0  # tokens it generated for us


class ServerPool:
    def __init__(self, addresses: Iterable[str], max_consecutive_errors: int = 3):
        self._lock = threading.Lock()
        self._servers: dict[str, PooledServer] = {}
        self._affinity: dict[str, str] = {}
        self._on_abandon: dict[str, dict[int, Callable[[], None]]] = {}  # address -> lease -> callback
        self._lease_ids = itertools.count()
        self.max_consecutive_errors = max_consecutive_errors
        # The routing heap: (outstanding, served, address, stamp); an entry is current while its
        # stamp is its server's in `_stamps` (non-routable servers have no current entry).
        self._heap: list[tuple[int, int, str, int]] = []
        self._stamps: dict[str, int] = {}
        self._next_stamp = itertools.count()
        self._routable = 0
        for a in addresses:
            self.add(a)

    # -- membership (the seam for a health monitor / discovery) --------------------------------
    def add(self, address: str) -> str:
        address = normalize_address(address)
        with self._lock:
            if address not in self._servers:
                self._servers[address] = PooledServer(address)
                self._routable += 1
                self._changed(self._servers[address])
        return address

    def remove(self, address: str) -> None:
        address = normalize_address(address)
        with self._lock:
            s = self._servers.pop(address, None)
            if s is not None and s.routable:
                self._routable -= 1
            self._stamps.pop(address, None)
            self._affinity = {r: a for r, a in self._affinity.items() if a != address}

    def set_routable(self, addresses: Iterable[str]) -> None:
        """Route to exactly `addresses` from now on (added when new; the others keep their
        counters but get no new request, and lose their affinities)."""
        wanted = [normalize_address(a) for a in addresses]
        with self._lock:
            for a in wanted:
                if a not in self._servers:
                    self._servers[a] = PooledServer(a, routable=False)
            keep = set(wanted)
            for s in self._servers.values():
                if s.routable and s.address not in keep:
                    s.healthy = False
                elif not s.routable and s.address in keep:
                    s.healthy, s.consecutive_errors = True, 0
                if s.routable != (s.address in keep):
                    s.routable = s.address in keep
                    self._changed(s)
            self._routable = len(keep)
            self._affinity = {r: a for r, a in self._affinity.items() if a in keep}

    @property
    def addresses(self) -> list[str]:
        """The routable servers."""
        with self._lock:
            return [s.address for s in self._servers.values() if s.routable]

    # -- routing --------------------------------------------------------------------------------
    def choose(self, rid: str, exclude: Iterable[str] = ()) -> str:
        """The server for `rid`; remembers the choice so a resubmission comes back."""
        excluded = set(exclude)
        with self._lock:
            if not self._routable:
                raise NoServerError("no server may serve now (none is healthy at the current weights)")
            sticky = self._servers.get(self._affinity.get(rid, ""))
            if sticky is not None and sticky.routable and sticky.healthy and sticky.address not in excluded:
                return sticky.address
            best = self._least_loaded(excluded)
            if best is None:  # no healthy server outside `exclude`: the rare fallbacks, by a scan
                routable = [s for s in self._servers.values() if s.routable]
                candidates = [s for s in routable if s.address not in excluded] or routable
                healthy = [s for s in candidates if s.healthy] or candidates
                best = min(healthy, key=lambda s: (s.outstanding, s.served, s.address))
            self._affinity[rid] = best.address
            return best.address

    def _least_loaded(self, excluded: set[str]) -> PooledServer | None:  # under self._lock
        """The healthy routable server outside `excluded` with the least (outstanding, served,
        address), from the heap; None when there is none."""
        heap, aside, found = self._heap, [], None
        while heap:
            _, _, address, stamp = heap[0]
            s = self._servers.get(address)
            if s is None or self._stamps.get(address) != stamp:
                heapq.heappop(heap)  # superseded by a later change, or the server is gone
            elif s.healthy and address not in excluded:
                found = s
                break
            else:
                aside.append(heapq.heappop(heap))  # current, but not eligible for this call
        for entry in aside:
            heapq.heappush(heap, entry)
        return found

    def _changed(self, s: PooledServer) -> None:  # under self._lock
        """`s`'s load or routability changed: its older heap entries are superseded."""
        stamp = next(self._next_stamp)
        self._stamps[s.address] = stamp
        if s.routable:
            heapq.heappush(self._heap, (s.outstanding, s.served, s.address, stamp))
            if len(self._heap) > 4 * len(self._servers) + 64:  # mostly superseded entries: rebuild
                self._heap = [(x.outstanding, x.served, x.address, self._stamps[x.address])
                              for x in self._servers.values() if x.routable]
                heapq.heapify(self._heap)

    def forget(self, rid: str) -> None:
        """Drop the affinity of a finished request (keeps the table bounded)."""
        with self._lock:
            self._affinity.pop(rid, None)

    @contextmanager
    def lease(self, address: str, on_abandon: Callable[[], None] | None = None) -> Iterator[None]:
        """Count one outstanding request on `address` for the duration of the block; `abandon(address)`
        meanwhile calls `on_abandon` (from the thread that abandons: it must be thread-safe)."""
        lease_id = next(self._lease_ids)
        with self._lock:
            state = self._servers.get(address)
            if state is not None:
                state.outstanding += 1
                state.served += 1
                self._changed(state)
            if on_abandon is not None:
                self._on_abandon.setdefault(address, {})[lease_id] = on_abandon
        try:
            yield
        finally:
            with self._lock:
                state = self._servers.get(address)
                if state is not None:
                    state.outstanding -= 1
                    self._changed(state)
                calls = self._on_abandon.get(address)
                if calls is not None:
                    calls.pop(lease_id, None)
                    if not calls:
                        del self._on_abandon[address]

    def abandon(self, address: str) -> int:
        """Give up on every call in flight to `address` (the membership evicted it): each lease's
        `on_abandon` runs, outside the lock. Returns how many calls were told."""
        address = normalize_address(address)
        with self._lock:
            callbacks = list(self._on_abandon.get(address, {}).values())
            if (s := self._servers.get(address)) is not None:
                s.healthy = False
        for callback in callbacks:
            callback()
        return len(callbacks)

    # -- health marks ---------------------------------------------------------------------------
    def mark_success(self, address: str, tokens: int = 0) -> None:
        """A call succeeded on `address` and generated `tokens`."""
        with self._lock:
            if (s := self._servers.get(address)) is not None:
                s.healthy, s.consecutive_errors = True, 0
                s.tokens += tokens

    def mark_error(self, address: str, connection_failed: bool) -> None:
        """A failed call: connection failures take the server out at once, 5xx after a streak."""
        with self._lock:
            if (s := self._servers.get(address)) is not None:
                s.consecutive_errors += 1
                if connection_failed or s.consecutive_errors >= self.max_consecutive_errors:
                    s.healthy = False

    def is_healthy(self, address: str) -> bool:
        with self._lock:
            s = self._servers.get(normalize_address(address))
            return s is not None and s.healthy

    def outstanding(self, address: str) -> int:
        with self._lock:
            s = self._servers.get(normalize_address(address))
            return s.outstanding if s is not None else 0

    def snapshot(self) -> list[PooledServer]:
        with self._lock:
            return [PooledServer(**vars(s)) for s in self._servers.values()]

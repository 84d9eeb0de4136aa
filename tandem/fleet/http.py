"""`HttpFleet`: the `Fleet` interface straight to a fixed list of server addresses over HTTP.

Every operation fans out to its targets (default: every address) at once from one background
event-loop thread (`ControlClient`, kept-alive connections) through the servers' `ServerAdapter`, and
collects one `ServerResult` per server: its answer, unreachable, no answer within the
operation's deadline, or given up (`abandon(address, why)`: an owner that evicted the server stops
waiting on it at once). A call still unanswered after `SLOW_CALL_S` is logged once, and again when
it ends. A `set_version(v)` the targets' acknowledged commit to `v` already set sends nothing. Not
elastic: `topology()` names every address as a member and nothing warms."""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from typing import Any

from tandem.aio import new_event_loop
from tandem.fleet import ops
from tandem.fleet.adapters import Capabilities, ServerAdapter, TandemAdapter
from tandem.fleet.control_http import ControlClient, Unreachable
from tandem.fleet.interface import Topology
from tandem.fleet.ranks import group_ranks
from tandem.fleet.results import FleetError, FleetResult, ServerResult

logger = logging.getLogger(__name__)

# A call to one server unanswered for this long is logged (which server, which operation, how long),
# once, and again when it ends: a stalled update names what it waits on while it waits.
SLOW_CALL_S = 5.0


def normalize_address(address: str) -> str:
    address = address.rstrip("/")
    return address if "://" in address else f"http://{address}"


class HttpFleet:
    def __init__(self, addresses: Sequence[str], *, adapter: ServerAdapter | None = None, api_key: str | None = None,
                 deadlines: ops.Deadlines | None = None, devices: int | Mapping[str, int] = 1):
        """`devices`: each server's devices (its ranks in a transfer group), one count for all or
        per address (absent ones: 1)."""
        if not addresses:
            raise ValueError("HttpFleet needs at least one server address")
        self.addresses = [normalize_address(a) for a in addresses]
        per_server = ({normalize_address(a): int(n) for a, n in devices.items()} if isinstance(devices, Mapping)
                      else dict.fromkeys(self.addresses, int(devices)))
        group_ranks(list(per_server.values()))  # each at least 1
        self.devices = {a: n for a, n in per_server.items() if n != 1}
        self.adapter = adapter or TandemAdapter()
        self._deadlines = deadlines or ops.Deadlines()
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._loop = new_event_loop()
        self._client: ControlClient | None = None  # made on the loop thread, at the first call
        self._thread = threading.Thread(target=self._loop.run_forever, name="tandem-fleet", daemon=True)
        self._thread.start()
        self._closed = False
        # The version each server holds as far as this fleet knows: set by a commit or version
        # call it acknowledged, forgotten when any other operation but a query starts on it.
        self._known_version: dict[str, int] = {}
        # Given-up servers: `abandon` bumps an address's count (any thread) and wakes its calls in
        # flight (loop thread); a call compares the count it started under, so none is missed.
        self._abandon_lock = threading.Lock()
        self._abandoned: dict[str, tuple[int, str]] = {}  # address -> (times abandoned, the last why)
        self._waiting: dict[str, set[asyncio.Future[str]]] = {}  # loop thread only
        self.slow_call_s = SLOW_CALL_S

    @property
    def world_size(self) -> int:
        return self.topology().ranks(self.addresses).world_size - 1

    @property
    def capabilities(self) -> Capabilities:
        return self.adapter.capabilities

    @property
    def deadlines(self) -> ops.Deadlines:
        return self._deadlines

    def topology(self) -> Topology:
        return Topology(0, tuple(self.addresses), devices=dict(self.devices))

    def admit(self, addresses: Sequence[str], version: int) -> None:
        return None  # a fixed list: every address is a member already

    def send(self, op: ops.FleetOp, request: Any, targets: Sequence[str] | None = None) -> Future[FleetResult]:
        """`op` on `targets` (any addresses; default: this fleet's); server i of them is index i
        for the adapter (which places it in a transfer group, `JoinGroup.rank_offset`)."""
        if self._closed:
            raise RuntimeError("this HttpFleet is closed")
        addresses = self.addresses if targets is None else [normalize_address(a) for a in targets]
        if op is ops.SET_VERSION and addresses and all(self._known_version.get(a) == request.version
                                                       for a in addresses):
            done: Future[FleetResult] = Future()
            done.set_result(FleetResult(op.name, tuple(
                ServerResult(a, True, f"weight version is already {request.version}", ops.Acknowledged())
                for a in addresses)))
            return done
        if not addresses:
            raise FleetError(op.name, [])  # "no server answered"
        calls = [self.adapter.request(op, request, i) for i in range(len(addresses))]  # may raise Unsupported
        if not op.query:
            for a in addresses:
                self._known_version.pop(a, None)
        timeout = self._deadlines.seconds(op.deadline)
        counts = [self._abandon_count(a) for a in addresses]
        return asyncio.run_coroutine_threadsafe(self._fanout(op, request, addresses, calls, timeout, counts),
                                                self._loop)

    async def _fanout(self, op: ops.FleetOp, request: Any, addresses: list[str], calls: list[Any],
                      timeout: float, counts: list[int]) -> FleetResult:
        # A collective cannot complete without every member: one given up, or unreachable, spoils it for the others.
        spoiled = self._loop.create_future() if op.collective else None
        answers = await asyncio.gather(*(self._post(op, a, c, timeout, n, spoiled)
                                         for a, c, n in zip(addresses, calls, counts, strict=True)))
        if op is ops.SET_VERSION or (op is ops.COMMIT and self.adapter.capabilities.commit_sets_version):
            for answer in answers:
                if answer.success:
                    self._known_version[answer.address] = request.version
        return FleetResult(op.name, tuple(answers)).raise_for_failures()

    def abandon(self, address: str, why: str) -> None:
        """Stop waiting on `address`: each call to it in flight, or sent to it before this returned,
        answers at once as given up (`no_answer`, saying `why`). Later calls go out as usual.
        Thread-safe."""
        address = normalize_address(address)
        with self._abandon_lock:
            count = self._abandoned.get(address, (0, ""))[0] + 1
            self._abandoned[address] = (count, why)
        if not self._closed:
            self._loop.call_soon_threadsafe(self._wake, address, why)

    def _abandon_count(self, address: str) -> int:
        with self._abandon_lock:
            return self._abandoned.get(address, (0, ""))[0]

    def _wake(self, address: str, why: str) -> None:  # loop thread
        for waiter in self._waiting.pop(address, set()):
            if not waiter.done():
                waiter.set_result(why)

    async def _post(self, op: ops.FleetOp, address: str, call: Any, timeout: float, count: int,
                    spoiled: asyncio.Future[str] | None) -> ServerResult:
        """The call to one server, raced against its abandonment (`count`: the address's abandon
        count when the call was sent) and, for a collective, against another member's (`spoiled`);
        logged when slow."""
        waiter: asyncio.Future[str] = self._loop.create_future()
        self._waiting.setdefault(address, set()).add(waiter)
        with self._abandon_lock:
            now, why = self._abandoned.get(address, (0, ""))
        if now != count:  # abandoned between the send and here
            waiter.set_result(why)
        request = asyncio.ensure_future(self._request(op, address, call, timeout))
        racing = {request, waiter} if spoiled is None else {request, waiter, spoiled}
        start = time.monotonic()
        try:
            done, _ = await asyncio.wait(racing, timeout=self.slow_call_s, return_when=asyncio.FIRST_COMPLETED)
            if not done:
                logger.warning("%s on %s: no answer yet after %.0fs (its deadline is %.0fs)", op.name, address,
                               self.slow_call_s, timeout)
                await asyncio.wait(racing, return_when=asyncio.FIRST_COMPLETED)
            waited = time.monotonic() - start
            if request.done():
                result = request.result()
                if result.no_answer and spoiled is not None and not spoiled.done():
                    # Unreachable (its process died as the call went out, before its eviction could
                    # give it up): out of the collective as surely, and the others would wait for it.
                    spoiled.set_result(f"{address} failed ({result.message}), and {op.name} cannot complete "
                                       "without it")
            elif waiter.done():
                result = ServerResult(address, False, f"given up after {waited:.1f}s: {waiter.result()}",
                                      no_answer=True)
                if spoiled is not None and not spoiled.done():
                    spoiled.set_result(f"{address} was given up ({waiter.result()}), and {op.name} cannot "
                                       "complete without it")
            else:  # answered or not, this server's part is spoiled: it is not to blame (it may answer)
                result = ServerResult(address, False, f"given up after {waited:.1f}s: {spoiled.result()}")
            if not done:
                logger.warning("%s on %s ended after %.1fs: %s", op.name, address, time.monotonic() - start,
                               "ok" if result.success else result.message)
            return result
        finally:
            waiters = self._waiting.get(address)
            if waiters is not None:
                waiters.discard(waiter)
                if not waiters:
                    del self._waiting[address]
            if not request.done():
                request.cancel()

    async def _request(self, op: ops.FleetOp, address: str, call: Any, timeout: float) -> ServerResult:
        if self._client is None:
            self._client = ControlClient(self._headers)
        try:
            reply = await self._client.request(call.method, address, call.path,
                                               json.dumps(call.body).encode() if call.method == "POST" else None,
                                               timeout=timeout)
        except TimeoutError:
            return ServerResult(address, False, f"no answer within {timeout:.1f}s", no_answer=True)
        except Unreachable as exc:
            return ServerResult(address, False, f"unreachable: {exc}", no_answer=True)
        text = reply.text()
        try:
            data = json.loads(text) if text else None
        except ValueError:
            data = None
        answer = self.adapter.answer(op, reply.status, data, text)
        return ServerResult(address, answer.success, answer.message, answer.value)

    def close(self) -> None:
        if self._closed:
            return

        async def shutdown() -> None:
            if self._client is not None:
                self._client.close()

        asyncio.run_coroutine_threadsafe(shutdown(), self._loop).result(10)
        self._closed = True
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()

    def __enter__(self) -> HttpFleet:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


"""`HttpFleet`: the `Fleet` interface straight to a fixed list of server addresses over HTTP.

Every operation fans out to its targets (default: every address) at once from one background
event-loop thread (aiohttp, kept-alive connections) through the servers' `ServerAdapter`, and
collects one `ServerResult` per server: its answer, unreachable, or no answer within the
operation's deadline. A `set_version(v)` the targets' acknowledged commit to `v` already set sends
nothing. Not elastic: `topology()` names every address as a member and nothing warms."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any

import aiohttp

from tandem.aio import new_event_loop
from tandem.fleet import ops
from tandem.fleet.adapters import Capabilities, ServerAdapter, TandemAdapter
from tandem.fleet.interface import Topology
from tandem.fleet.results import FleetError, FleetResult, ServerResult


def normalize_address(address: str) -> str:
    address = address.rstrip("/")
    return address if "://" in address else f"http://{address}"


class HttpFleet:
    def __init__(self, addresses: Sequence[str], *, adapter: ServerAdapter | None = None, api_key: str | None = None,
                 deadlines: ops.Deadlines | None = None):
        if not addresses:
            raise ValueError("HttpFleet needs at least one server address")
        self.addresses = [normalize_address(a) for a in addresses]
        self.adapter = adapter or TandemAdapter()
        self._deadlines = deadlines or ops.Deadlines()
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._loop = new_event_loop()
        self._session: aiohttp.ClientSession | None = None
        self._thread = threading.Thread(target=self._loop.run_forever, name="tandem-fleet", daemon=True)
        self._thread.start()
        self._closed = False
        # The version each server holds as far as this fleet knows: set by a commit or version
        # call it acknowledged, forgotten when any other operation but a query starts on it.
        self._known_version: dict[str, int] = {}

    @property
    def world_size(self) -> int:
        return len(self.addresses)

    @property
    def capabilities(self) -> Capabilities:
        return self.adapter.capabilities

    @property
    def deadlines(self) -> ops.Deadlines:
        return self._deadlines

    def topology(self) -> Topology:
        return Topology(0, tuple(self.addresses))

    def admit(self, addresses: Sequence[str], version: int) -> None:
        return None  # a fixed list: every address is a member already

    def send(self, op: ops.FleetOp, request: Any, targets: Sequence[str] | None = None) -> Future[FleetResult]:
        """`op` on `targets` (any addresses; default: this fleet's); server i of them is index i
        for the adapter (its rank in a transfer group)."""
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
        return asyncio.run_coroutine_threadsafe(self._fanout(op, request, addresses, calls, timeout), self._loop)

    async def _fanout(self, op: ops.FleetOp, request: Any, addresses: list[str], calls: list[Any],
                      timeout: float) -> FleetResult:
        answers = await asyncio.gather(*(self._post(op, a, c, timeout)
                                         for a, c in zip(addresses, calls, strict=True)))
        if op is ops.SET_VERSION or (op is ops.COMMIT and self.adapter.capabilities.commit_sets_version):
            for answer in answers:
                if answer.success:
                    self._known_version[answer.address] = request.version
        return FleetResult(op.name, tuple(answers)).raise_for_failures()

    async def _post(self, op: ops.FleetOp, address: str, call: Any, timeout: float) -> ServerResult:
        if self._session is None:
            # No per-host limit: calls fan out. `tandem serve` sets TCP_NODELAY on accepted sockets.
            self._session = aiohttp.ClientSession(headers=self._headers, connector=aiohttp.TCPConnector(limit=0))
        try:
            async with self._session.request(call.method, address + call.path,
                                             json=call.body if call.method == "POST" else None,
                                             timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
                text = await resp.text()
                try:
                    data = json.loads(text) if text else None
                except ValueError:
                    data = None
                answer = self.adapter.answer(op, resp.status, data, text)
                return ServerResult(address, answer.success, answer.message, answer.value)
        except TimeoutError:
            return ServerResult(address, False, f"no answer within {timeout:.1f}s", no_answer=True)
        except aiohttp.ClientError as exc:
            return ServerResult(address, False, f"unreachable: {type(exc).__name__}: {exc}", no_answer=True)

    def close(self) -> None:
        if self._closed:
            return

        async def shutdown() -> None:
            if self._session is not None:
                await self._session.close()

        asyncio.run_coroutine_threadsafe(shutdown(), self._loop).result(10)
        self._closed = True
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()

    def __enter__(self) -> HttpFleet:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


"""`HttpFleet`: the `Fleet` interface straight to a list of server addresses over HTTP.

Every operation fans out to all servers at once from one background event-loop thread (aiohttp,
one session, kept-alive connections, no polling) through the servers' `ServerAdapter`, and collects
one `ServerResult` per server: its answer, that it could not be reached, or that it did not answer
within the operation's deadline (`Deadlines.seconds(op.deadline)`).

`set_version(v)` right after a commit to `v` that every server acknowledged costs nothing: the
commit set the version together with the weights, so nothing is sent.
"""

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
from tandem.fleet.results import FleetResult, ServerResult


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
        # The version every server holds as far as this fleet knows: set by a commit or version
        # call every server acknowledged, forgotten when any other operation but a query starts.
        self._known_version: int | None = None

    @property
    def world_size(self) -> int:
        return len(self.addresses)

    @property
    def capabilities(self) -> Capabilities:
        return self.adapter.capabilities

    @property
    def deadlines(self) -> ops.Deadlines:
        return self._deadlines

    def send(self, op: ops.FleetOp, request: Any) -> Future[FleetResult]:
        if self._closed:
            raise RuntimeError("this HttpFleet is closed")
        if op is ops.SET_VERSION and self._known_version == request.version:
            done: Future[FleetResult] = Future()
            done.set_result(FleetResult(op.name, tuple(
                ServerResult(a, True, f"weight version is already {request.version}", ops.Acknowledged())
                for a in self.addresses)))
            return done
        calls = [self.adapter.request(op, request, i) for i in range(len(self.addresses))]  # may raise Unsupported
        if not op.query:
            self._known_version = None
        timeout = self._deadlines.seconds(op.deadline)
        return asyncio.run_coroutine_threadsafe(self._fanout(op, request, calls, timeout), self._loop)

    async def _fanout(self, op: ops.FleetOp, request: Any, calls: list[Any], timeout: float) -> FleetResult:
        answers = await asyncio.gather(*(self._post(op, a, c, timeout)
                                         for a, c in zip(self.addresses, calls, strict=True)))
        result = FleetResult(op.name, tuple(answers)).raise_for_failures()
        if op is ops.COMMIT or op is ops.SET_VERSION:
            self._known_version = request.version  # reached only when every server acknowledged
        return result

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
            return ServerResult(address, False, f"no answer within {timeout:.1f}s")
        except aiohttp.ClientError as exc:
            return ServerResult(address, False, f"unreachable: {type(exc).__name__}: {exc}")

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


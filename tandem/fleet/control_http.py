"""`ControlClient`: the control plane's HTTP/1.1 client, for small calls to many servers at once
(health probes, fleet operations).

Each call is one request on a kept-alive connection to its server (a new one when none is idle),
its reply parsed by httptools (uvicorn's parser), the whole call bounded by its `timeout` (then
`TimeoutError`). A connection refused, reset or closed before the reply ends raises `Unreachable`;
a GET that met a kept-alive connection the server had just closed goes again once on a new one (as
aiohttp does); a POST never goes twice. A call cancelled or timed out closes its connection (a
reply still owed cannot share it). `http://` and `https://` addresses, with an optional path
prefix.

Why not aiohttp here: at 1,000 servers a probe round and every fan-out of a weight update are
1,000 calls from one event loop, and aiohttp's per-call work (its request, response and stream
objects, header multidicts, timers) costs 2-5x this client's CPU per call: at 1,000 simulated
servers, probes fell from 7.5-9% of a core to 2-4% and one fan-out from 0.37-0.68 s to 0.17-0.31 s
(docs/architecture.md, "Scale"). Generation requests keep aiohttp's client, with its per-host
connection limits.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Mapping
from dataclasses import dataclass
from urllib.parse import urlsplit

import httptools

# Methods a client may send again when a kept-alive connection turns out to be closed (RFC 9110 9.2.2).
IDEMPOTENT = frozenset({"GET", "HEAD", "OPTIONS", "PUT", "DELETE"})


@dataclass(frozen=True)
class Reply:
    status: int
    body: bytes

    def text(self) -> str:
        return self.body.decode("utf-8", "replace")


class Unreachable(Exception):
    """No reply can come: the connection was refused, reset, or closed before the reply ended."""


@dataclass(frozen=True)
class _Origin:
    key: tuple[str, str, int]  # scheme, host, port: the connections' pool
    prefix: str  # the address's path, put before each call's path
    host: str  # the Host header


class _Connection(asyncio.Protocol):
    """One TCP (or TLS) connection and the reply it waits for, if any."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.reply: asyncio.Future[Reply] | None = None
        self.body: list[bytes] = []
        self.received = False  # a byte of the current reply arrived
        self.delimited = False  # the current reply says where its body ends (length or chunks)
        self.headers_done = False
        self.keep_alive = True
        self.closed = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.received = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(Unreachable(f"a malformed reply: {exc}"))
            assert self.transport is not None
            self.transport.abort()

    # -- httptools callbacks --------------------------------------------------------------------------
    def on_header(self, name: bytes, value: bytes) -> None:
        if name.lower() in (b"content-length", b"transfer-encoding"):
            self.delimited = True

    def on_headers_complete(self) -> None:
        self.headers_done = True

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        self.keep_alive = self.parser.should_keep_alive()
        self._complete()

    # -- the end of a reply ---------------------------------------------------------------------------
    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.headers_done and not self.delimited:  # a body that ends with the connection: it has
            self.keep_alive = False
            self._complete()
        self._fail(Unreachable("the server closed the connection" + (f": {exc}" if exc else "")
                               + (" before it replied" if not self.received else " in the middle of its reply")))

    def _complete(self) -> None:
        reply, self.reply = self.reply, None
        if reply is not None and not reply.done():
            reply.set_result(Reply(self.parser.get_status_code(), b"".join(self.body)))
        self.body, self.received, self.delimited, self.headers_done = [], False, False, False

    def _fail(self, exc: Exception) -> None:
        reply, self.reply = self.reply, None
        if reply is not None and not reply.done():
            reply.set_exception(exc)


class ControlClient:
    """Calls over kept-alive connections, one event loop's (the one its calls run on)."""

    def __init__(self, headers: Mapping[str, str] | None = None):
        """`headers`: sent with every call (e.g. Authorization)."""
        self._headers = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
        self._origins: dict[str, _Origin] = {}
        self._idle: dict[tuple[str, str, int], list[_Connection]] = {}
        self._ssl: ssl.SSLContext | None = None
        self._closed = False

    async def request(self, method: str, address: str, path: str, body: bytes | None = None, *,
                      timeout: float, content_type: str = "application/json") -> Reply:
        """`method` `address` + `path` (with `body`, for a POST); -> its reply, whatever its status.
        Raises `TimeoutError` past `timeout` seconds, `Unreachable` when no reply can come."""
        if self._closed:
            raise RuntimeError("this ControlClient is closed")
        origin = self._origin(address)
        head = f"{method} {origin.prefix}{path} HTTP/1.1\r\nHost: {origin.host}\r\n{self._headers}"
        if body is not None or method == "POST":
            body = body or b""
            head += f"Content-Type: {content_type}\r\nContent-Length: {len(body)}\r\n"
        data = (head + "\r\n").encode("latin-1") + (body or b"")
        async with asyncio.timeout(timeout):
            conn, reused = await self._connection(origin)
            try:
                return await self._exchange(origin, conn, data)
            except Unreachable:
                if not (reused and not conn.received and method in IDEMPOTENT):
                    raise
            conn, _ = await self._connection(origin, reuse=False)
            return await self._exchange(origin, conn, data)

    async def _connection(self, origin: _Origin, reuse: bool = True) -> tuple[_Connection, bool]:
        """An idle connection to `origin` (-> reused True) or a new one."""
        idle = self._idle.get(origin.key)
        while reuse and idle:
            conn = idle.pop()
            if not conn.closed:
                return conn, True
        scheme, host, port = origin.key
        if scheme == "https" and self._ssl is None:
            self._ssl = ssl.create_default_context()
        try:
            _, conn = await asyncio.get_running_loop().create_connection(
                _Connection, host, port, ssl=self._ssl if scheme == "https" else None)
        except OSError as exc:
            raise Unreachable(f"cannot connect to {host}:{port}: {exc}") from exc
        return conn, False

    async def _exchange(self, origin: _Origin, conn: _Connection, data: bytes) -> Reply:
        assert conn.transport is not None
        reply: asyncio.Future[Reply] = asyncio.get_running_loop().create_future()
        conn.reply = reply
        conn.transport.write(data)
        try:
            answer = await reply
        except BaseException:
            conn.transport.abort()  # a reply still owed (or a broken one): nothing else may use it
            raise
        if conn.keep_alive and not conn.closed and not self._closed:
            self._idle.setdefault(origin.key, []).append(conn)
        else:
            conn.transport.close()
        return answer

    def _origin(self, address: str) -> _Origin:
        origin = self._origins.get(address)
        if origin is None:
            parts = urlsplit(address)
            if parts.scheme not in ("http", "https") or not parts.hostname:
                raise ValueError(f"{address!r} is not an http:// or https:// address")
            port = parts.port or (443 if parts.scheme == "https" else 80)
            netloc = parts.netloc.rsplit("@", 1)[-1]
            origin = _Origin((parts.scheme, parts.hostname, port), parts.path.rstrip("/"), netloc)
            self._origins[address] = origin
        return origin

    def close(self) -> None:
        """Close every idle connection; calls in flight close theirs when they end. Call it on the
        loop the calls ran on."""
        self._closed = True
        for conns in self._idle.values():
            for conn in conns:
                if conn.transport is not None:
                    conn.transport.close()
        self._idle.clear()

"""A TCP proxy on the loopback in front of one server, run in a thread of its own, that can make the
link bad on demand: this machine's kernel has no `netem` (`tc qdisc ... netem` answers "Specified
qdisc kind is unknown"), so bench/chaos.py slows a server's link here.

    proxy = FaultyProxy(server_port, seed=0)   # http://127.0.0.1:{proxy.port} reaches the server
    proxy.impair(latency_s=0.2, reset_p=0.2, drop_p=0.1)   # then proxy.impair() to heal it
    proxy.close()

While impaired, every chunk is held `latency_s` before it is passed on (both ways), a new connection
is reset (RST) with probability `reset_p`, and a chunk of a response is cut in half and the
connection reset with probability `drop_p` (bytes dropped mid-answer). `counts` says how often each
happened. Each connection lives only as long as its two ends; `close` ends them all.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import socket
import struct
import threading
from collections import Counter

CONNECT_TIMEOUT_S = 5.0
CHUNK = 65536


def _reset(writer: asyncio.StreamWriter) -> None:
    """Close with an RST, as a dropped link or a crashed peer does."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


class FaultyProxy:
    def __init__(self, target_port: int, seed: int = 0, target_host: str = "127.0.0.1"):
        self.target = (target_host, target_port)
        self.latency_s, self.reset_p, self.drop_p = 0.0, 0.0, 0.0
        self.counts: Counter[str] = Counter()
        self._rng = random.Random(seed)
        self._loop = asyncio.new_event_loop()
        self._conns: set[asyncio.Task] = set()
        self._server: asyncio.Server | None = None
        started = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(started,), name="chaos-proxy", daemon=True)
        self._thread.start()
        if not started.wait(10) or self._server is None:
            raise RuntimeError("the proxy did not start")
        self.port: int = self._server.sockets[0].getsockname()[1]

    def impair(self, latency_s: float = 0.0, reset_p: float = 0.0, drop_p: float = 0.0) -> None:
        self.latency_s, self.reset_p, self.drop_p = latency_s, reset_p, drop_p

    def close(self) -> None:
        if self._loop.is_closed():
            return
        asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    def _run(self, started: threading.Event) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._server = self._loop.run_until_complete(asyncio.start_server(self._accept, "127.0.0.1", 0))
        finally:
            started.set()
        self._loop.run_forever()
        self._loop.close()

    async def _shutdown(self) -> None:
        assert self._server is not None
        self._server.close()
        for task in list(self._conns):
            task.cancel()
        await asyncio.gather(*self._conns, return_exceptions=True)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._conns.add(task)
        try:
            await self._serve(reader, writer)
        finally:
            self._conns.discard(task)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._rng.random() < self.reset_p:
            self.counts["resets"] += 1
            _reset(writer)
            return
        try:
            up_reader, up_writer = await asyncio.wait_for(asyncio.open_connection(*self.target), CONNECT_TIMEOUT_S)
        except (OSError, TimeoutError):
            _reset(writer)
            return
        self.counts["connections"] += 1
        pipes = [asyncio.create_task(self._pipe(reader, up_writer, writer, response=False)),
                 asyncio.create_task(self._pipe(up_reader, writer, up_writer, response=True))]
        try:
            # A reset ends both ways; an end of stream one way leaves the other to finish.
            done, pending = await asyncio.wait(pipes, return_when=asyncio.FIRST_EXCEPTION)
            if any(not t.cancelled() and t.exception() is not None for t in done):
                for task in pending:
                    task.cancel()
            await asyncio.gather(*pipes, return_exceptions=True)
        finally:
            for task in pipes:
                task.cancel()
            for w in (writer, up_writer):
                w.transport.abort()

    async def _pipe(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter, other: asyncio.StreamWriter,
                    response: bool) -> None:
        while chunk := await src.read(CHUNK):
            if self.latency_s:
                self.counts["delayed"] += 1
                await asyncio.sleep(self.latency_s)
            if response and self._rng.random() < self.drop_p:
                self.counts["drops"] += 1
                dst.write(chunk[: len(chunk) // 2])
                with contextlib.suppress(OSError, ConnectionError):
                    await dst.drain()
                _reset(dst)
                _reset(other)
                raise ConnectionResetError("bytes dropped")
            dst.write(chunk)
            await dst.drain()
        if dst.can_write_eof():
            with contextlib.suppress(OSError):
                dst.write_eof()

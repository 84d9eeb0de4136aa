"""uvicorn as the rollout side runs it: on a socket bound beforehand (so the port is known before
serving starts), leaving the process's signal handlers alone, and idle without polling.

Used by the controller's callback server (its own loop, in a thread) and by the agent proxy (on
the loop that runs the episodes).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading

import uvicorn
from starlette.types import ASGIApp


def listen_socket(host: str, port: int) -> tuple[socket.socket, str]:
    """A listening TCP socket on `host:port` (0: any free port) and its `http://host:port` address."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(256)
    bound_host, bound_port = sock.getsockname()[:2]
    return sock, f"http://{f'[{bound_host}]' if ':' in bound_host else bound_host}:{bound_port}"


class EventServer(uvicorn.Server):
    """uvicorn whose main loop waits for `request_stop` instead of waking every 0.1 s to check a flag."""

    def __init__(self, app: ASGIApp):
        super().__init__(uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off",
                                        timeout_graceful_shutdown=5, timeout_keep_alive=60))
        self.started_event = threading.Event()
        self.ready: asyncio.Future[None] | None = None  # set by a caller on the serving loop: resolved once serving
        self._stop: asyncio.Event | None = None

    def capture_signals(self):  # a server in a thread or on a shared loop leaves the process's signals alone
        return contextlib.nullcontext()

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        self._stop = asyncio.Event()
        await super().startup(sockets=sockets)
        self.started_event.set()
        if self.ready is not None and not self.ready.done():
            self.ready.set_result(None)

    async def main_loop(self) -> None:
        await self.on_tick(0)  # sets the default headers once
        assert self._stop is not None
        await self._stop.wait()

    def request_stop(self) -> None:
        """Stop serving (call on the server's loop)."""
        self.should_exit = True
        if self._stop is not None:
            self._stop.set()

"""Event loops for Tandem's asyncio threads and processes: uvloop (libuv) where it is installed,
asyncio's own loop otherwise. uvloop roughly halves the latency of a small HTTP call on loopback
(~0.56 -> ~0.31 ms per POST to `tandem serve` with httptools, measured on 2 CPU cores), which every
control call of a weight update and every rollout request pays. `tandem serve` gets the same
through uvicorn, which picks uvloop and httptools by itself when they are installed.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")

try:
    import uvloop
except ImportError:  # e.g. Windows, where uvloop does not exist
    uvloop = None


def new_event_loop() -> asyncio.AbstractEventLoop:
    """A fresh event loop: uvloop's when available."""
    return uvloop.new_event_loop() if uvloop is not None else asyncio.new_event_loop()


def run(coro: Coroutine[Any, Any, T]) -> T:
    """`asyncio.run(coro)` on a loop from `new_event_loop`."""
    with asyncio.Runner(loop_factory=new_event_loop) as runner:
        return runner.run(coro)

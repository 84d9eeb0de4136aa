"""A call on a thread of its own, for tests that act on a server while a request runs."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import ParamSpec, TypeVar

P = ParamSpec("P")
R = TypeVar("R")


def in_thread(fn: Callable[P, R], *args: P.args, **kwargs: P.kwargs) -> Future[R]:
    """`fn(*args, **kwargs)` started now on a fresh thread; the future gives its result or raises
    what it raised. The thread ends with the call (nothing waits for it here)."""
    pool = ThreadPoolExecutor(1)
    try:
        return pool.submit(fn, *args, **kwargs)
    finally:
        pool.shutdown(wait=False)

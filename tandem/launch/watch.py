"""`ExitWatcher`: be told at once when a launched process exits, without polling.

A daemon thread blocks on the processes' sentinels (pidfds) and a wake-up pipe; when one becomes
readable the process has exited, and `on_exit(process, status)` runs on that thread (keep it short,
never let it raise). The launcher uses it so a server crash evicts the server at once instead of
after the health monitor's failed probes.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Callable
from multiprocessing.connection import wait

from tandem.launch.process import LaunchedProcess

logger = logging.getLogger(__name__)


class ExitWatcher:
    def __init__(self, on_exit: Callable[[LaunchedProcess, str], None]):
        self.on_exit = on_exit
        self._lock = threading.Lock()
        self._watched: dict[int, LaunchedProcess] = {}  # sentinel -> process
        self._wake_r, self._wake_w = os.pipe()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="tandem-exit-watch", daemon=True)
        self._thread.start()

    def add(self, proc: LaunchedProcess) -> None:
        with self._lock:
            if proc.sentinel >= 0:
                self._watched[proc.sentinel] = proc
        self._wake()

    def discard(self, proc: LaunchedProcess) -> None:
        """Stop watching `proc` (the launcher stops it on purpose)."""
        with self._lock:
            self._watched = {s: p for s, p in self._watched.items() if p is not proc}
        self._wake()

    def close(self) -> None:
        with self._lock:
            self._closed = True
        self._wake()
        self._thread.join(5)
        for fd in (self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                os.close(fd)

    def _wake(self) -> None:
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"x")

    def _run(self) -> None:
        while True:
            with self._lock:
                if self._closed:
                    return
                watched = dict(self._watched)
            try:
                ready = wait([self._wake_r, *watched])
            except (OSError, ValueError):  # a sentinel was closed under us (the launcher released it)
                with self._lock:
                    self._watched = {s: p for s, p in self._watched.items() if p.sentinel == s}
                continue
            if self._wake_r in ready:
                with contextlib.suppress(OSError):
                    os.read(self._wake_r, 4096)
            for sentinel in ready:
                proc = watched.get(sentinel)
                if proc is None:
                    continue
                with self._lock:
                    if self._closed or self._watched.pop(sentinel, None) is None:
                        continue
                try:
                    self.on_exit(proc, proc.exit_status(wait_s=1.0))
                except Exception:
                    logger.exception("handling the exit of %s failed", proc.name)

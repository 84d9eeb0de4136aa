"""`run` (one program, now) and `SandboxPool` (many, `workers` at a time, one slot each)."""

from __future__ import annotations

import queue
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from tandem.sandbox.availability import require
from tandem.sandbox.config import SandboxConfig
from tandem.sandbox.execution import Execution, execute


def run(program: str | Path, stdin: bytes | None = None, limits: SandboxConfig | None = None) -> Execution:
    """Run one program (source text, or a file's path) in a fresh sandbox as slot 0; raises
    SandboxUnavailable where isolation is not possible (it never runs the program unisolated)."""
    limits = limits or SandboxConfig()
    return execute(program, stdin, limits, require(limits), slot=0)


class SandboxPool:
    """Runs executions concurrently, at most `config.workers` at once, each in its own slot (uid
    `uid_base + slot`, so per-uid limits count that slot's processes alone). Construction raises
    SandboxUnavailable when isolation is not possible. Use as a context manager, or `close()`."""

    def __init__(self, config: SandboxConfig | None = None):
        self.config = config or SandboxConfig()
        self._tools = require(self.config)
        self._slots: queue.SimpleQueue[int] = queue.SimpleQueue()
        for slot in range(self.config.workers):
            self._slots.put(slot)
        self._threads = ThreadPoolExecutor(self.config.workers, thread_name_prefix="tandem-sandbox")

    def submit(self, program: str | Path, stdin: bytes | None = None) -> Future[Execution]:
        return self._threads.submit(self._execute, program, stdin)

    def run(self, program: str | Path, stdin: bytes | None = None) -> Execution:
        return self.submit(program, stdin).result()

    def map(self, jobs: Iterable[tuple[str | Path, bytes | None]]) -> list[Execution]:
        """Executions of (program, stdin) pairs, in their order."""
        return [f.result() for f in [self.submit(p, s) for p, s in jobs]]

    def _execute(self, program: str | Path, stdin: bytes | None) -> Execution:
        slot = self._slots.get()
        try:
            return execute(program, stdin, self.config, self._tools, slot)
        finally:
            self._slots.put(slot)

    def close(self) -> None:
        self._threads.shutdown(wait=True)

    def __enter__(self) -> SandboxPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

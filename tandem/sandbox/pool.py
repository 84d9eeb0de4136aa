"""`run` (one program, now) and `SandboxPool` (many, `workers` at a time, one slot each)."""

from __future__ import annotations

import queue
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from tandem.sandbox.availability import require
from tandem.sandbox.config import SandboxConfig
from tandem.sandbox.execution import Deadline, Execution, execute
from tandem.sandbox.uids import UidLease


def run(program: str | Path, stdin: bytes | None = None, limits: SandboxConfig | None = None,
        deadline: Deadline | None = None) -> Execution:
    """Run one program (source text, or a file's path) in a fresh sandbox, as a uid leased for it;
    raises SandboxUnavailable where isolation is not possible (it never runs the program unisolated)."""
    limits = limits or SandboxConfig()
    tools = require(limits)
    with UidLease(limits.uid_base, 1) as lease:
        return execute(program, stdin, limits, tools, lease.uids[0], deadline)


class SandboxPool:
    """Runs executions concurrently, at most `config.workers` at once, each slot as its own uid,
    leased from `uid_base` up for the pool's life (`tandem.sandbox.uids`: per-uid limits then count
    that slot's processes alone, whatever other pools run on the host). Construction raises
    SandboxUnavailable when isolation is not possible. Use as a context manager, or `close()`."""

    def __init__(self, config: SandboxConfig | None = None):
        self.config = config or SandboxConfig()
        self._tools = require(self.config)
        self._lease = UidLease(self.config.uid_base, self.config.workers)
        self._slots: queue.SimpleQueue[int] = queue.SimpleQueue()
        for uid in self._lease.uids:
            self._slots.put(uid)
        self._threads = ThreadPoolExecutor(self.config.workers, thread_name_prefix="tandem-sandbox")

    @property
    def uids(self) -> list[int]:
        """The slots' uids (all the current user's without root)."""
        return list(self._lease.uids)

    def submit(self, program: str | Path, stdin: bytes | None = None,
               deadline: Deadline | None = None) -> Future[Execution]:
        return self._threads.submit(self._execute, program, stdin, deadline)

    def run(self, program: str | Path, stdin: bytes | None = None, deadline: Deadline | None = None) -> Execution:
        return self.submit(program, stdin, deadline).result()

    def map(self, jobs: Iterable[tuple[str | Path, bytes | None]], deadline: Deadline | None = None) -> list[Execution]:
        """Executions of (program, stdin) pairs, in their order. If waiting is interrupted (the
        reward runner's timer), executions not yet started are cancelled; started ones end by
        `deadline` or their wall limit."""
        futures = [self.submit(p, s, deadline) for p, s in jobs]
        try:
            return [f.result() for f in futures]
        except BaseException:
            for f in futures:
                f.cancel()
            raise

    def _execute(self, program: str | Path, stdin: bytes | None, deadline: Deadline | None) -> Execution:
        uid = self._slots.get()
        try:
            return execute(program, stdin, self.config, self._tools, uid, deadline)
        finally:
            self._slots.put(uid)

    def close(self) -> None:
        self._threads.shutdown(wait=True, cancel_futures=True)
        self._lease.close()

    def __enter__(self) -> SandboxPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

"""The sandbox as a reward sees it: a reward that has a `sandbox` parameter gets a `Sandbox`.

    def score(prompt_text, completion_text, prompt_ids, completion_ids, *, sandbox, tests, **fields):
        return sandbox.run(code_of(completion_text), tests).fraction

The reward runner passes one bound to its worker process's pool (one pool per process, with
`rollout.sandbox`'s limits) and to the call's deadline, so that every execution ends before the
reward's own timeout. Outside the runner `Sandbox()` runs with default limits and no deadline."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import astuple
from pathlib import Path

from tandem.sandbox.checks import Test, TestReport, run_tests
from tandem.sandbox.config import SandboxConfig
from tandem.sandbox.execution import Deadline, Execution
from tandem.sandbox.pool import SandboxPool

_lock = threading.Lock()
_pools: dict[tuple, SandboxPool] = {}


def process_pool(config: SandboxConfig) -> SandboxPool:
    """This process's pool for `config`, made on first use and kept for the process's life (its
    uids stay leased until the process exits). Raises SandboxUnavailable where isolation is not possible."""
    key = astuple(config)
    with _lock:
        pool = _pools.get(key)
        if pool is None:
            pool = _pools[key] = SandboxPool(config)
        return pool


class Sandbox:
    """Runs a reward's programs isolated, each execution ending at its wall limit or at `deadline`."""

    def __init__(self, config: SandboxConfig | None = None, deadline: Deadline | None = None):
        self.config = config or SandboxConfig()
        self.deadline = deadline

    def run(self, code: str, tests: Sequence[Test]) -> TestReport:
        """`code` checked against `tests`: assert statements (strings), or stdin/stdout pairs
        (`StdioTest` or `{"input": ..., "output": ...}`); one execution per test, run at once up
        to `rollout.sandbox.workers`."""
        return run_tests(code, tests, pool=process_pool(self.config), deadline=self.deadline)

    def execute(self, program: str | Path, stdin: str | bytes | None = None) -> Execution:
        """One program with `stdin`, as `tandem sandbox run` runs it."""
        data = stdin.encode() if isinstance(stdin, str) else stdin
        return process_pool(self.config).run(program, data, self.deadline)

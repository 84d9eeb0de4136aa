"""`tandem.launch.guard`: importing it is cheap; `die_with_creator`: a process pool's workers die
with the process that owns the pool, even when it is SIGKILLed, and even when it dies before a
worker armed the signal; the fork server, the resource tracker and the pool's semaphores go with
them. Real processes, read from /proc."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.launch.pool_owner import GONE_WITHIN_S, kill_owner_and_check, start_owner
from tests.launch.procs import CHILD_ENV, REPO, Marked

pytestmark = pytest.mark.timeout(120)


def test_the_guard_does_not_import_torch():
    """Every server's exec wrapper and every reward pool worker's initializer import the guard:
    `tandem.launch` loads its modules on first use, so that costs no torch import (~1.2 s CPU)."""
    out = subprocess.run([sys.executable, "-c", "import json, sys, tandem.launch.guard; print(json.dumps(list(sys.modules)))"],
                         cwd=REPO, env={**os.environ, **CHILD_ENV}, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    modules = json.loads(out.stdout)
    assert "torch" not in modules and "tandem.launch.rpc" not in modules


@pytest.mark.parametrize("method", ["forkserver", "spawn"])
@pytest.mark.parametrize("delay_s", [0.0, 1.5], ids=["armed", "owner-died-first"])
def test_pool_workers_die_with_their_owner(method, delay_s):
    """armed: the owner dies after the workers armed the signal. owner-died-first: the owner
    dies while a worker is still starting (before its initializer armed it)."""
    marked = Marked()
    try:
        proc, workers = start_owner(marked, "tests.launch.pool_owner", "pool", method, str(delay_s))
        kill_owner_and_check(marked, proc, workers, f"{method}, {'armed' if delay_s == 0 else 'owner died first'}",
                             within_s=GONE_WITHIN_S + delay_s)
    finally:
        marked.clean_up()

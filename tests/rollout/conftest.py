"""Fixtures: fake servers (in-process or as subprocesses) and a bounded asyncio runner."""

from __future__ import annotations

import asyncio
import os
import select
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.rollout.fake_server import FakeServer

REPO = Path(__file__).resolve().parents[2]


def run(coro, timeout: float = 20.0):
    """Run a coroutine on a fresh loop, bounded by `timeout` seconds."""
    return asyncio.run(asyncio.wait_for(coro, timeout))


@pytest.fixture
def make_server() -> Iterator:
    started: list[FakeServer] = []

    def make(**config) -> FakeServer:
        server = FakeServer(**config).start()
        started.append(server)
        return server

    yield make
    for s in started:
        s.stop()


@pytest.fixture
def spawn_server() -> Iterator:
    """Start `python -m tests.rollout.fake_server ARGS` and return its address."""
    procs: list[subprocess.Popen] = []

    def spawn(*args: str) -> tuple[str, subprocess.Popen]:
        proc = subprocess.Popen(
            [sys.executable, "-m", "tests.rollout.fake_server", *args],
            cwd=REPO, stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        procs.append(proc)
        ready, _, _ = select.select([proc.stdout], [], [], 20.0)
        assert ready, "fake server subprocess did not report its port within 20 s"
        line = proc.stdout.readline().split()
        assert line and line[0] == "PORT", f"unexpected fake server output {line!r}"
        return f"http://127.0.0.1:{line[1]}", proc

    yield spawn
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait(5)
        p.stdout.close()


def score_killing_a_server(scorer, batches: list, victim) -> int:
    """Score `batches` (lists of trajectories, concurrently) with a started `ScoringFleet`, the
    `victim` server SIGKILLed once 4 trajectories are scored (both servers have taken calls by
    then: least outstanding first); -> the client's resubmitted calls. Closes scorer and victim."""
    import signal

    async def score_and_kill() -> None:
        tasks = [asyncio.ensure_future(scorer.ascore(b)) for b in batches]
        while scorer.scored < 4:  # bounded by run's timeout
            await asyncio.sleep(0.01)
        victim.proc.send_signal(signal.SIGKILL)
        await asyncio.gather(*tasks)

    scorer.start(on_too_small=lambda exc: None)
    try:
        run(score_and_kill(), timeout=120)
        return scorer.client.resubmitted_total
    finally:
        scorer.close()
        victim.stop()

"""A `tandem train` run leaves nothing behind: no process and no /dev/shm object of the run, after
SIGKILL of its controller (mid-run, and while it is still starting its children), after Ctrl-C and
after a normal end. And `LocalScheduler` teardown removes weight segments a trainer it killed left.

Each run is a real controller (`python -m tandem.cli train`: 2 servers, 2 trainer ranks, the reward
pool, a tiny model). Its environment carries a token that every process of the run inherits, so
the processes of the run are read from /proc/*/environ, orphans included; its /dev/shm objects are
those its processes map (the reward pool's semaphores, weight segments) and weight segments named
after one of its pids (`procs.Marked`). Both lists must be empty within `GONE_WITHIN_S`.

Figures are printed (`pytest -rP tests/launch/test_run_cleanup.py` shows them).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tandem.launch import LocalScheduler
from tests.launch.helpers import CPU, HELPERS, HelperWorker
from tests.launch.procs import CHILD_ENV, REPO, SHM, Marked, alive, cmdline

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]

GONE_WITHIN_S = 10.0
START_S = 240.0  # until the first training step is logged (2 shared cores, other work beside)


def _default_sigint() -> None:
    # As in test_local: a suite started in the background inherits SIGINT ignored.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


class Run:
    """A controller started in its own session: its process group is what a terminal's Ctrl-C
    reaches (the controller and what it started through multiprocessing; servers and trainer
    ranks have sessions of their own)."""

    def __init__(self, tmp_path: Path, model: Path, sync: str, workers: int, steps: int):
        self.marked = Marked()
        self.metrics = tmp_path / "demo" / "run" / "metrics.jsonl"
        self.log_path = tmp_path / "controller.log"
        cmd = [sys.executable, "-m", "tandem.cli", "train", str(REPO / "examples" / "demo.yaml"),
               f"actor.path={model}", f"experiment.fileroot={tmp_path}", f"train.total_steps={steps}",
               f"train.weight_sync={sync}", f"rollout.workers={workers}", "task.eval_size=4",
               "gen.n_samples=4", "rollout.consumer_batch_size=4", "stats.progress=false", "stats.plot=false"]
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(cmd, cwd=REPO, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True, env={**os.environ, **CHILD_ENV, **self.marked.env},
                                         preexec_fn=_default_sigint)

    def wait_for(self, what: str, done) -> None:
        deadline = time.monotonic() + START_S
        while not done():
            assert self.proc.poll() is None, f"the controller exited ({self.proc.returncode}):\n{self.tail()}"
            assert time.monotonic() < deadline, f"{what} not within {START_S:.0f}s:\n{self.tail()}"
            self.marked.scan()
            time.sleep(0.1)

    def trained(self) -> bool:
        """A training step is logged (the first row is the evaluation before training)."""
        try:
            lines = self.metrics.read_text().splitlines()
        except FileNotFoundError:
            return False
        return any(json.loads(line).get("step", 0) >= 1 for line in lines if line.endswith("}"))

    def end(self, how: str, timeout: float) -> tuple[int, float]:
        """SIGKILL, Ctrl-C or wait for the end; -> (exit status, seconds until the controller exited)."""
        sent = time.monotonic()
        if how == "sigkill":
            self.proc.kill()
        elif how == "sigint":
            os.killpg(self.proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does
        try:
            rc = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the controller did not exit ({how}):\n{self.tail()}")
        return rc, time.monotonic() - sent

    def assert_nothing_left(self, label: str, exited_s: float) -> None:
        left, objects, took = self.marked.wait_gone(GONE_WITHIN_S)
        print(f"{label}: controller exited after {exited_s:.1f}s; {len(self.marked.pids)} processes and "
              f"{_kinds(self.marked.objects)} seen; {len(left)} processes and {len(objects)} objects left "
              f"{took:.2f}s later")
        assert not left and not objects, (f"left {took:.1f}s after the controller exited:\n"
                                          f"{self.marked.describe(left, objects)}\n"
                                          f"--- controller log ---\n{self.tail()}")

    def tail(self, lines: int = 30) -> str:
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return "\n".join(text.splitlines()[-lines:])

    def clean_up(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self.marked.clean_up()


def _kinds(objects: set[str]) -> str:
    sems = sum(o.startswith("sem.") for o in objects)
    return f"{sems} semaphores and {len(objects) - sems} weight segments in /dev/shm"


CASES = {
    # how the run ends, weight sync, rollout worker processes
    "sigkill-distributed": ("sigkill", "distributed", 0),  # the controller's own reward pool
    "sigkill-shm-workers": ("sigkill", "shm", 1),  # a rollout worker process and its reward pool
    "ctrl-c-shm": ("sigint", "shm", 0),
    "end-shm-workers": ("end", "shm", 1),
}


@pytest.mark.parametrize("how,sync,workers", list(CASES.values()), ids=list(CASES))
def test_run_leaves_nothing(tmp_path, tiny_model, how, sync, workers):
    run = Run(tmp_path, tiny_model, sync, workers, steps=2 if how == "end" else 30)
    try:
        run.wait_for("a training step", run.trained)
        commands = [cmdline(p) for p in run.marked.scan()]
        # Not vacuous: the run is all there, reward pool included, and holds the objects in question.
        assert run.proc.pid in run.marked.pids
        assert sum("tandem.cli serve" in c for c in commands) == 2
        assert sum("tandem.train.worker" in c for c in commands) == 2
        assert any("multiprocessing.forkserver" in c for c in commands), commands
        assert any("multiprocessing.resource_tracker" in c for c in commands), commands
        assert any(o.startswith("sem.mp-") for o in run.marked.objects), run.marked.objects
        if sync == "shm":
            assert any(o.startswith("tandem-w-") for o in run.marked.objects), run.marked.objects
        rc, exited = run.end(how, timeout=30 if how != "end" else START_S)
        if how == "end":
            assert rc == 0, run.tail()
        run.assert_nothing_left(f"{how} ({sync} sync, {workers} rollout workers, rc {rc})", exited)
    finally:
        run.clean_up()


def test_sigkill_while_starting_leaves_nothing(tmp_path, tiny_model):
    """The controller dies while its children start: the servers are loading and the trainer
    ranks have just been started and are importing torch. Catches a rank that arms the parent-death
    signal only after its imports: it outlives the controller by as long as they take (seconds, and
    more than `GONE_WITHIN_S` on a loaded machine)."""
    run = Run(tmp_path, tiny_model, "distributed", 0, steps=30)
    try:
        run.wait_for("the trainer ranks' processes",
                     lambda: sum("tandem.train.worker" in cmdline(p) for p in run.marked.scan()) == 2)
        _, exited = run.end("sigkill", timeout=30)
        run.assert_nothing_left("sigkill while starting", exited)
    finally:
        run.clean_up()


def test_teardown_removes_segments_a_killed_trainer_left(tmp_path):
    """A trainer's weight segments are unlinked by its resource tracker once it is gone; teardown
    SIGKILLs whole process groups, tracker included, so the scheduler removes what remains.
    Here the tracker is killed first (the race lost every time) and the trainer never closes."""
    sched = LocalScheduler(tmp_path / "run", env=CHILD_ENV, grace_s=5)
    try:
        group = sched.start_workers(1, HELPERS, args=CPU, timeout_s=120)
        names = group.call(HelperWorker.make_segments, 2)[0]
        tracker = group.call(HelperWorker.resource_tracker_pid)[0]
        assert names and all((SHM / n).exists() for n in names)
        if tracker is not None:
            os.kill(tracker, signal.SIGKILL)
            while alive(tracker):
                time.sleep(0.01)
    finally:
        sched.shutdown()
    left = [n for n in names if (SHM / n).exists()]
    for n in left:
        (SHM / n).unlink()
    assert not left, "weight segments of a trainer killed at teardown survived it"

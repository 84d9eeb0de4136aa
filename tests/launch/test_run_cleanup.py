"""A run leaves nothing behind: `LocalScheduler` teardown removes the weight segments of a
trainer it killed (whose resource tracker it may have killed too)."""

from __future__ import annotations

import os
import signal
import time

import pytest

from tandem.launch import LocalScheduler
from tests.launch.procs import CHILD_ENV, SHM, alive

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]

H = "tests.launch.helpers"


def test_teardown_removes_segments_a_killed_trainer_left(tmp_path):
    """A trainer's weight segments are unlinked by its resource tracker once it is gone; teardown
    SIGKILLs whole process groups, tracker included, so the scheduler removes what remains.
    Here the tracker is killed first (the race lost every time) and the trainer never closes."""
    sched = LocalScheduler(tmp_path / "run", env=CHILD_ENV, grace_s=5)
    try:
        group = sched.start_workers(1, timeout_s=120)
        names = group.call("call", f"{H}:make_segments", 2)[0]
        tracker = group.call("call", f"{H}:resource_tracker_pid")[0]
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

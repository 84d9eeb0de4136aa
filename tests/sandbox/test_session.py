"""What rewards use: uids leased per pool (distinct across pools and processes), an execution cut at a
deadline before its wall limit, a pool whose interrupted `map` cancels what has not started, and
the `Sandbox` handle with its per-process pool."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from tandem.sandbox import Deadline, Sandbox, SandboxPool, process_pool, run
from tandem.sandbox.uids import UidLease
from tests.sandbox.conftest import ROOT, UID_BASE, bwrap_missing, limits, sandbox_processes

pytestmark = pytest.mark.skipif(bwrap_missing() is not None, reason=str(bwrap_missing()))
root_only = pytest.mark.skipif(os.geteuid() != 0, reason="uids are leased only as root (otherwise the user's own)")
BASE = UID_BASE + 16  # clear of the uids the other sandbox test modules use


@root_only
def test_leases_in_one_process_and_in_another_never_share_a_uid():
    """Two leases here take consecutive free uids; a process holding a lease keeps its uids out of
    ours until it dies (SIGKILL: the kernel drops its locks), then they are free again."""
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {str(ROOT)!r})
        from tandem.sandbox.uids import UidLease
        lease = UidLease({BASE}, 2)
        print(lease.uids, flush=True)
        time.sleep(60)
    """)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == f"[{BASE}, {BASE + 1}]"
        with UidLease(BASE, 2) as a, UidLease(BASE, 1) as b:
            assert a.uids == [BASE + 2, BASE + 3] and b.uids == [BASE + 4]
        holder.kill()
        holder.wait()
        with UidLease(BASE, 3) as c:
            assert c.uids == [BASE, BASE + 1, BASE + 2]
    finally:
        holder.kill()
        holder.wait()
        holder.stdout.close()


@root_only
def test_two_pools_run_as_different_uids():
    program = "import os\nprint(os.getuid())\n"
    with SandboxPool(limits(uid_base=BASE)) as one, SandboxPool(limits(uid_base=BASE)) as two:
        assert set(one.uids).isdisjoint(two.uids)
        seen = {int(one.run(program).stdout), int(two.run(program).stdout)}
    assert len(seen) == 2 and seen <= set(range(BASE, BASE + 4))


def test_a_deadline_before_the_wall_limit_ends_the_execution_and_says_so():
    start = time.monotonic()
    result = run("import time\ntime.sleep(60)\n", None, limits(uid_base=BASE, wall_s=30.0, cpu_s=30.0),
                 Deadline(time.monotonic() + 1.0, "reward call's time (task.reward_timeout_s=1 s)"))
    took = time.monotonic() - start
    assert (result.status, result.reason) == ("timeout", "the reward call's time (task.reward_timeout_s=1 s) ran out")
    assert 0.9 < took < 10.0, took
    past = run("print(1)", None, limits(uid_base=BASE), Deadline(time.monotonic() - 1.0, "x"))
    assert (past.status, past.reason) == ("timeout", "the x ran out before the program started")
    later = run("print(1)", None, limits(uid_base=BASE, wall_s=5.0), Deadline(time.monotonic() + 60.0, "x"))
    assert later.ok  # a deadline after the wall limit changes nothing


def test_an_interrupted_map_cancels_what_has_not_started():
    """The reward runner's timer interrupts a reward inside `map`: the queued executions never
    start, the running one ends at its deadline, and the pool serves the next call."""
    config = limits(uid_base=BASE, workers=1, wall_s=30.0, cpu_s=30.0)

    class Alarm(Exception):
        pass

    def on_alarm(signum, frame):
        raise Alarm

    with SandboxPool(config) as pool:
        previous = signal.signal(signal.SIGALRM, on_alarm)
        signal.setitimer(signal.ITIMER_REAL, 1.0)
        deadline = Deadline(time.monotonic() + 1.5, "call's time")
        start = time.monotonic()
        try:
            with pytest.raises(Alarm):
                pool.map([("import time\nprint('ran', flush=True)\ntime.sleep(60)\n", None)] * 5, deadline)
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)
        after = pool.run("print(6 * 7)")
        took = time.monotonic() - start
        assert after.stdout == "42\n"
        assert took < 10.0, took  # not four more 60 s sleeps, nor one 30 s wall limit
        assert not [p for p in sandbox_processes(range(BASE, BASE + 8)) if "main.py" in p[2]]


def test_sandbox_runs_tests_and_programs_on_one_pool_per_process():
    config = limits(uid_base=BASE + 32)  # these pools live as long as this process
    box = Sandbox(config)
    report = box.run("def f(x):\n    return x + 1\n", ["assert f(1) == 2", "assert f(2) == 4",
                                                        {"input": "", "output": ""}])
    assert [o.passed for o in report.outcomes] == [True, False, True]
    assert box.execute("print(input()[::-1])", "abc").stdout == "cba\n"
    assert process_pool(config) is process_pool(limits(uid_base=BASE + 32))  # the same limits, the same pool
    assert process_pool(config) is not process_pool(limits(uid_base=BASE + 32, wall_s=7.0))

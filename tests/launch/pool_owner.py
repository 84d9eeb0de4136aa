"""A process that owns a process pool, for the parent-death tests of its workers.

    python -m tests.launch.pool_owner runner
    python -m tests.launch.pool_owner pool METHOD DELAY

`runner`: a `RewardRunner` (forkserver workers) scores one reward, so its pool is up.
`pool`: a `ProcessPoolExecutor` (start method METHOD) whose worker runs `die_with_creator`
DELAY seconds after it starts (`late_guard`); with DELAY 0 the owner waits for a task, so the
worker has armed the signal. Prints one JSON line with the pool's worker pids, then "ready",
then waits to be killed. `start_owner` and `kill_owner_and_check` are the tests' side.
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import os
import select
import subprocess
import sys
import time
from concurrent.futures import ProcessPoolExecutor

from tests.launch.procs import CHILD_ENV, REPO, Marked, cmdline

# A bound against leaks, not a speed: the chain (the fork server sees its pipe close and exits,
# its workers get their parent-death signal, the resource tracker sees EOF, unlinks the
# semaphores and exits) takes 0.05-0.9 s here, and passed 5 s once on a loaded host (the tracker
# still exiting, its semaphores already unlinked: a suite run at ae0f097).
GONE_WITHIN_S = 20.0


def late_guard(creator_pid: int, delay_s: float) -> None:
    """A pool initializer that arms `die_with_creator` only after `delay_s`: the creator may be
    gone by then (a worker still starting when its creator dies)."""
    from tandem.launch.guard import die_with_creator

    time.sleep(delay_s)
    die_with_creator(creator_pid)


def start_owner(marked: Marked, module: str, *args: str) -> tuple[subprocess.Popen, list[int]]:
    """`python -m MODULE ARGS` (this one, or another owner that speaks the same way), marked,
    once it printed "ready"; -> (process, the pids its JSON line names)."""
    proc = subprocess.Popen([sys.executable, "-m", module, *args], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True, bufsize=0,
                            env={**os.environ, **CHILD_ENV, **marked.env})
    lines: list[str] = []
    deadline = time.monotonic() + 60
    while "ready" not in lines:
        left = deadline - time.monotonic()
        assert left > 0 and proc.poll() is None, f"{module} did not get ready:\n" + "\n".join(lines)
        if select.select([proc.stdout], [], [], left)[0]:
            lines.append(proc.stdout.readline().decode().strip())
    return proc, json.loads(next(x for x in lines if x.startswith("{")))["workers"]


def kill_owner_and_check(marked: Marked, proc: subprocess.Popen, workers: list[int], label: str,
                         within_s: float = GONE_WITHIN_S, pool: bool = True) -> None:
    """SIGKILL the owner; nothing of its tree may be left within `within_s`. `pool`: it owns a
    process pool, so its resource tracker and the pool's semaphores must be there to begin with."""
    pids = marked.scan()
    assert set(workers) <= set(pids) and len(workers) >= 1
    if pool:
        assert any("resource_tracker" in cmdline(p) for p in pids), [cmdline(p) for p in pids]
        assert any(o.startswith("sem.mp-") for o in marked.objects), marked.objects  # the pool's queues
    proc.kill()
    proc.wait()
    left, objects, took = marked.wait_gone(within_s)
    print(f"{label}: {len(pids)} processes ({len(workers)} workers) and {len(marked.objects)} semaphores; "
          f"{len(left)} processes and {len(objects)} semaphores left {took:.2f}s after SIGKILL of the owner")
    assert not left and not objects, f"left after SIGKILL of the owner:\n{marked.describe(left, objects)}"


def main() -> None:
    kind = sys.argv[1]
    if kind == "runner":
        from tandem.rollout import RewardRunner
        from tests.rollout import rewards

        runner = RewardRunner(max_workers=2, timeout_s=30)
        assert asyncio.run(runner.ascore(rewards.parity_reward, "p", "c", [1], [2])).value == 1.0
        workers = list(runner._pool._processes)
    else:
        # By its module name (this file runs as __main__): pool workers import it from there.
        from tests.launch.pool_owner import late_guard as initializer

        method, delay = sys.argv[2], float(sys.argv[3])
        pool = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context(method),
                                   initializer=initializer, initargs=(os.getpid(), delay))
        task = pool.submit(os.getpid)  # starts the worker
        if delay == 0:
            task.result()  # runs after the initializer
        workers = list(pool._processes)
    print(json.dumps({"workers": workers}), flush=True)
    print("ready", flush=True)
    time.sleep(600)


if __name__ == "__main__":
    main()

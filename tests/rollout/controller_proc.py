"""A rollout controller in a process of its own, to measure what it costs while it waits.

    python -m tests.rollout.controller_proc --servers URL[,URL] [--workers K] [--wait 3]

Starts a `RolloutController` (with K rollout worker processes), submits one episode to the (slow)
servers, lets it get going, then blocks in `wait(1, timeout=WAIT)` and prints one JSON line: the
controller process's CPU seconds during the wait (`time.process_time`, all its threads: executor
loop, callback server, worker monitor), and the worker processes' CPU seconds over the same window
(from /proc). The episode is expected to be still running when the wait times out.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from tandem.rollout import RolloutConfig, RolloutController
from tests.rollout.test_controller import Echo


def proc_cpu_s(pid: int) -> float:
    """utime + stime of a process, in seconds (clock ticks of /proc/PID/stat)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--servers", required=True)
    p.add_argument("--workers", type=int, default=0)
    p.add_argument("--wait", type=float, default=3.0)
    p.add_argument("--max-new-tokens", type=int, default=64)
    args = p.parse_args(argv)
    config = RolloutConfig(servers=args.servers.split(","), workers=args.workers, request_deadline_s=120)
    with RolloutController(config) as ctl:
        ctl.submit([1, 2], Echo(max_new_tokens=args.max_new_tokens))
        time.sleep(0.5)  # dispatch, (worker,) first HTTP call: all under way before the window opens
        pids = ctl.workers.pids if ctl.workers is not None else []
        running = ctl.stats()["running"]
        cpu0, workers0, wall0 = time.process_time(), sum(map(proc_cpu_s, pids)), time.monotonic()
        try:
            ctl.wait(1, timeout=args.wait)
            finished = True
        except TimeoutError:
            finished = False
        cpu, wall = time.process_time() - cpu0, time.monotonic() - wall0
        workers_cpu = sum(map(proc_cpu_s, pids)) - workers0
        print(json.dumps({"controller_cpu_s": cpu, "workers_cpu_s": workers_cpu, "wall_s": wall,
                          "running": running, "finished": finished, "workers": len(pids)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

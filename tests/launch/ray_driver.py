"""A controller that drives a `RayScheduler` inside a loopback-only network namespace (run by
`tests/launch/test_ray_scheduler.py` under `unshare --net`): a 2-rank group of `HelperWorker`s in a
placement group, an all_reduce over it, then rank 1's Ray actor killed mid-call, then a group the
cluster could never place (its 3 CPUs, scheduler.ray.num_cpus, win over the 5 the scheduler is
told the run needs). Prints one JSON line,
with what Ray says of the `scheduler.ray` keys the driver sets (cluster CPUs, namespace, the
placement group's strategy and bundles).

    python -m tests.launch.ray_driver RUN_DIR
"""

from __future__ import annotations

import json
import sys
import threading
import time

import ray
from ray.util import placement_group_table

from tandem.launch.ray_cluster import RayScheduler
from tandem.launch.rpc import WorkerCrashedError
from tandem.launch.scheduler import LaunchError, RunProcesses
from tandem.rl.config import load_run_config
from tests.launch.helpers import CPU, HELPERS, HelperWorker
from tests.launch.procs import alive


def main(run_dir: str) -> None:
    result: dict[str, object] = {}
    config = load_run_config(None, ["scheduler.ray.num_cpus=3", "scheduler.ray.strategy=SPREAD",
                                    "scheduler.ray.cpus_per_process=0.5", "scheduler.ray.namespace=tdm-driver"])
    # the run declares 10 ranks (5 CPUs at 0.5 each): scheduler.ray.num_cpus=3, set, still wins
    sched = RayScheduler(run_dir, config.scheduler.ray, processes=RunProcesses(ranks=10))
    try:
        group = sched.start_workers("archon:d2", HELPERS, args=CPU, timeout_s=120)
        table = placement_group_table(sched.placement_groups[0])
        result["ray"] = {"cpus": ray.cluster_resources().get("CPU"), "namespace": ray.get_runtime_context().namespace,
                         "strategy": table["strategy"], "bundles": list(table["bundles"].values())}
        result["sums"] = group.call(HelperWorker.all_reduce_sum, 1.5)
        result["placement"] = sched.placement()
        victim = sched.roles[1]
        # both ranks are inside a 30 s call when the Ray actor of rank 1 is killed
        threading.Timer(1.0, lambda: ray.kill(victim.actor)).start()  # type: ignore[attr-defined]
        began = time.monotonic()
        try:
            group.call(HelperWorker.sleep, 30.0)
        except WorkerCrashedError as exc:
            result["crash"] = str(exc)
            result["crash_after_s"] = time.monotonic() - began
        pids = [p.pid for p in sched.roles]
        # 8 bundles of 0.5 CPU on a 3-CPU cluster: refused at once, not after the placement timeout
        began = time.monotonic()
        try:
            sched.start_workers("archon:d8", HELPERS, args=CPU, timeout_s=120)
            result["impossible"] = "placed"
        except LaunchError as exc:
            result["impossible"] = str(exc)
        result["impossible_after_s"] = time.monotonic() - began
    finally:
        sched.shutdown()
    # a killed actor's process is SIGKILLed and handed to init, which reaps it when it likes:
    # a zombie has ended, so it does not count as left
    result["left"] = [pid for pid in pids if alive(pid)]
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])

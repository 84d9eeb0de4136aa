"""A controller for the Ctrl-C test: one server and two trainer workers, then a long RPC call.

    python -m tests.launch.controller_proc MODEL_DIR RUN_DIR

Prints one JSON line with every child's pid, then "ready", then blocks inside a worker call
(where a real controller spends its time) until it is interrupted.
"""

from __future__ import annotations

import faulthandler
import json
import signal
import sys

from tandem.launch import LocalScheduler
from tests.launch.helpers import CPU, HELPERS, HelperWorker
from tests.launch.procs import CHILD_ENV


def main() -> None:
    model, run_dir = sys.argv[1], sys.argv[2]
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the test's view of a hang
    sched = LocalScheduler(run_dir, env=CHILD_ENV, grace_s=10)
    sched.start_servers(1, model, server_args=["--num-threads", "1"], timeout_s=120)
    group = sched.start_workers(2, HELPERS, args=CPU, timeout_s=120)
    print(json.dumps({"pids": [p.pid for p in sched.processes]}), flush=True)
    print("ready", flush=True)
    group.call(HelperWorker.sleep, 120.0)
    print("the call returned: the signal did not arrive", flush=True)


if __name__ == "__main__":
    main()

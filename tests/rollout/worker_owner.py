"""A controller whose rollout worker is stuck with its event loop blocked, for the parent-death test.

    python -m tests.rollout.worker_owner SERVER_URL MARKER_PATH

Starts a `RolloutController` with one rollout worker and submits an `Echo` episode that blocks the
worker's event loop for 120 s (as CPU work done in place would), so the worker cannot act on its
command pipe closing. Once the episode says it blocks (MARKER_PATH exists), prints the worker pids
as JSON, then "ready", then waits to be killed.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from tandem.rollout import RolloutConfig, RolloutController
from tests.rollout.test_controller import Echo


def main() -> None:
    server, marker = sys.argv[1], Path(sys.argv[2])
    ctl = RolloutController(RolloutConfig(servers=[server], workers=1))
    ctl.submit(("block", str(marker)), Echo())
    deadline = time.monotonic() + 60
    while not marker.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    print(json.dumps({"workers": ctl.workers.pids}), flush=True)
    print("ready", flush=True)
    time.sleep(600)


if __name__ == "__main__":
    main()

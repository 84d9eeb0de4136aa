"""The control plane at 200 simulated servers (bench/_simfleet.py: real HTTP, one process): the
real controller runs 800 episodes (200 at a time, 20 ms a token) while 2 servers are killed and 2
stopped with requests on them.
No episode is lost, every episode's tokens continue the fleet's chain across resubmissions, and
each struck server is evicted within interval x threshold + 1 s (a stopped one: plus the probe's
timeout, which is how long its last probe waits). bench/scale.py runs the same at 10-1,000."""

from __future__ import annotations

import json
import resource
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tandem.rollout.health import HealthConfig
from tandem.rollout.membership import MemberState

BENCH = Path(__file__).resolve().parents[2] / "bench"
pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def scale(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))  # bench/scale.py imports its siblings by name
    import scale as module

    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 8192)), hard))
    yield module
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    for name in ("scale", "_simfleet", "_report"):
        sys.modules.pop(name, None)


def test_200_servers_lose_no_episode_and_struck_ones_are_evicted_in_bound(scale):
    health = HealthConfig(interval_s=1.0, timeout_s=0.5, failure_threshold=3)
    with scale.SimFleetProcesses(200) as fleet:
        ctl = scale.controller(fleet.addresses, health, batch=800, concurrency=200)
        try:
            scale.wait_until(lambda: scale.healthy(ctl) == 200, 30, "200 servers healthy")
            kills, stops = scale.struck(200)
            out = scale.churn(fleet, ctl, 800, kills, stops, health)
            states = {r["address"]: r["state"] for r in ctl.members()["servers"]}
        finally:
            ctl.shutdown()
        counts, _ = fleet.counts()
    print(f"\n{out}")
    assert out["trajectories"] == 800 and out["lost"] == 0, out
    assert out["chained"], out  # resubmitted episodes continue their own tokens
    assert out["resubmitted"] >= 2, out  # the struck servers had requests in flight
    assert counts["generate/abort"] == 0, counts  # nothing paused: every answer was whole
    assert 0 < out["kill_evict_s"] <= out["kill_bound_s"] == 4.0, out
    assert 0 < out["stop_evict_s"] <= out["stop_bound_s"] == 4.5, out
    assert [states[fleet.addresses[i]] for i in kills] == ["evicted"] * len(kills)
    assert sum(state == "healthy" for state in states.values()) >= 200 - len(kills) - len(stops)


def test_a_partition_of_400_servers_is_evicted_within_the_bound(scale):
    """400 of 450 servers stop answering at once (a partition): they are evicted within interval x
    threshold + timeout + 1 s, and the 50 that still answer stay. Behind aiohttp's default limit of
    100 connections, the probes of the answering servers queued behind the stopped ones' and timed
    out with them: healthy servers were evicted too."""
    health = HealthConfig(interval_s=1.0, timeout_s=0.5, failure_threshold=3)
    with scale.SimFleetProcesses(450) as fleet:
        ctl = scale.controller(fleet.addresses, health, batch=8, concurrency=8)
        try:
            scale.wait_until(lambda: scale.healthy(ctl) == 450, 30, "450 servers healthy")
            cut = fleet.addresses[:400]  # probed first in each round
            for index in range(400):
                fleet.command("stop", index)
            struck = time.monotonic()
            bound = health.interval_s * health.failure_threshold + health.timeout_s + 1.0
            scale.wait_until(lambda: all(ctl.fleet.membership.record(a).state is MemberState.EVICTED
                                         for a in cut), 30, "the partitioned servers evicted")
            took = time.monotonic() - struck
            healthy = scale.healthy(ctl)
        finally:
            ctl.shutdown()
    print(f"\n400 stopped servers evicted {took:.2f}s after the partition (bound {bound:.1f}s)")
    assert took <= bound, took
    assert healthy == 50, healthy


CHILD = """
import json, resource, sys
sys.path.insert(0, sys.argv[1])
import scale
from tandem.fleet import ops
from tandem.rollout.health import HealthConfig

hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
resource.setrlimit(resource.RLIMIT_NOFILE, (600, hard))  # below what 450 servers need
with scale.SimFleetProcesses(450) as fleet:  # the fleet's process raises its own
    ctl = scale.controller(fleet.addresses, HealthConfig(interval_s=3600), batch=8, concurrency=8)
    try:
        scale.wait_until(lambda: scale.healthy(ctl) == 450, 30, "450 servers healthy")
        failures = []
        for op, request in ((ops.PAUSE, ops.PauseGeneration()), (ops.CONTINUE, ops.ContinueGeneration())):
            failures += [r.message for r in ctl.send(op, request).result(60).failures]
    finally:
        ctl.shutdown()
print(json.dumps({"soft": resource.getrlimit(resource.RLIMIT_NOFILE)[0], "failures": failures[:3],
                  "failed": len(failures)}))
"""


def test_a_controller_under_a_low_open_file_limit_raises_it_for_a_large_fleet():
    """A soft limit of 600 open files (1,024 is a common default) and 450 servers: a probe
    connection and a fleet-operation connection each are 900. The controller raises its soft limit
    toward the hard one; without that, the fan-outs past the limit failed as unreachable servers
    ("Too many open files")."""
    proc = subprocess.run([sys.executable, "-c", CHILD, str(BENCH)], capture_output=True, text=True, timeout=120,
                          cwd=BENCH.parent)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["failed"] == 0, out
    assert out["soft"] > 600, out

"""The rollout side of an elastic fleet, with real server processes and real signals.

- kill -9 one of three servers in the middle of a rollout: every episode completes on the others
  (the interrupted requests are resubmitted with what they had generated), none is lost, the dead
  server is evicted by the health monitor within interval x threshold + 1 s, and routing never
  sends to it again.
- SIGSTOP a server: the probes time out and it is evicted; after SIGCONT it answers again and
  comes back through the join path (joining -> warming), never straight to healthy.
- SIGSTOP a server with requests in flight: at its eviction the calls waiting on it are given up
  and the requests finish on the other server, long before their deadline.
- While fewer than `min_servers` are healthy no episode starts; past the grace period the rollouts
  fail with `FleetTooSmall`, naming the servers and why.
"""

from __future__ import annotations

import json
import os
import signal
import time
import urllib.request

import pytest

from tandem.fleet.generation import GenerationParams
from tandem.rollout import ModelRequest, RolloutConfig, RolloutController, RolloutWorkflow
from tandem.rollout.elastic import FleetTooSmall
from tandem.rollout.health import HealthConfig
from tandem.rollout.membership import MemberState
from tests.rollout.fake_server import chain

pytestmark = pytest.mark.timeout(120)
HEALTH = HealthConfig(interval_s=0.5, timeout_s=0.5, failure_threshold=3)


class Generate(RolloutWorkflow):
    """Items are token-id lists; each episode generates `n` tokens."""

    def __init__(self, n: int):
        self.params = GenerationParams(max_new_tokens=n)

    async def arun_episode(self, client, item):
        resp = await client.agenerate(ModelRequest(list(item), self.params))
        return resp.to_trajectory(prompt_id=str(item[0]))


def victim_requests(address: str):
    """How many generation requests a fake server has seen (its /health says), or -1 once it is gone."""
    def count() -> int:
        try:
            with urllib.request.urlopen(address + "/health", timeout=2) as resp:
                return int(json.loads(resp.read()).get("requests", 0))
        except OSError:
            return -1
    return count


def wait_until(predicate, timeout: float, what: str) -> float:
    start = time.monotonic()
    while not predicate():
        assert time.monotonic() - start < timeout, f"{what} within {timeout}s"
        time.sleep(0.02)
    return time.monotonic() - start


@pytest.mark.parametrize("workers", [0, 1])
def test_kill_9_mid_rollout_loses_nothing(spawn_server, workers):
    """With `workers=1` the episodes run in a rollout worker process, whose client learns the
    healthy set through its pipe."""
    servers = [spawn_server("--token-delay", "0.01") for _ in range(3)]
    addresses = [a for a, _ in servers]
    victim_address, victim = servers[1]
    config = RolloutConfig(servers=addresses, health=HEALTH, max_concurrent_rollouts=24, consumer_batch_size=48,
                           max_head_offpolicyness=0, request_deadline_s=60, workers=workers)
    items = [[i + 1] for i in range(48)]
    with RolloutController(config) as ctl:
        for item in items:
            ctl.submit(item, Generate(60))
        server_log = victim_requests(victim_address)
        wait_until(lambda: server_log() >= 3, 20, "the victim gets requests")
        victim.send_signal(signal.SIGKILL)
        killed = time.monotonic()
        bound = HEALTH.interval_s * HEALTH.failure_threshold + 1.0  # the bound: interval x threshold + 1 s
        evicted = wait_until(lambda: ctl.fleet.membership.record(victim_address).state is MemberState.EVICTED,
                             bound, "the dead server is evicted")
        print(f"\nevicted {evicted:.2f}s after kill -9 (bound {bound:.1f}s)")
        trajs = ctl.wait(48, timeout=60)
        assert time.monotonic() - killed < 60
        metrics = ctl.step_metrics()
    assert len(trajs) == 48
    for t in trajs:  # every episode complete, and the chain unbroken across the resubmission
        assert t.input_ids[1:] == chain(t.input_ids[0], 60, 1000)
    assert metrics["rollout/lost_total"] == 0
    assert metrics["rollout/resubmitted_total"] >= 3
    assert metrics["fleet/evicted_total"] == 1 and metrics["fleet/healthy"] == 2
    assert victim_address not in ctl.pool.addresses


def test_sigstop_evicts_and_sigcont_comes_back_through_the_join_path(spawn_server):
    servers = [spawn_server() for _ in range(2)]
    address, proc = servers[0]
    config = RolloutConfig(servers=[a for a, _ in servers], health=HEALTH)
    with RolloutController(config) as ctl:
        os.kill(proc.pid, signal.SIGSTOP)
        try:
            wait_until(lambda: ctl.fleet.membership.record(address).state is MemberState.EVICTED,
                       HEALTH.interval_s * HEALTH.failure_threshold + HEALTH.timeout_s + 1.0,
                       "the stopped server is evicted")
            assert address not in ctl.pool.addresses
        finally:
            os.kill(proc.pid, signal.SIGCONT)
        seen = set()

        def warming() -> bool:
            state = ctl.fleet.membership.record(address).state
            seen.add(state)
            return state is MemberState.WARMING

        wait_until(warming, 10, "the revived server is warming")
        assert MemberState.HEALTHY not in seen  # never straight back to serving
        assert address not in ctl.pool.addresses  # no traffic before it is warmed and admitted
        assert address in ctl.topology().warming or not ctl.topology().warming  # due after the cooldown


@pytest.mark.parametrize("workers", [0, 1])
def test_sigstop_mid_rollout_moves_its_requests_at_eviction(spawn_server, workers):
    """A stopped server keeps its connections open and never answers: before `ServerPool.abandon`
    its requests waited out `request_deadline_s` (600 s in `tandem train`) and their episodes
    failed, although the health monitor had evicted it within seconds. With `workers=1` the
    eviction reaches the worker's client through its pipe."""
    servers = [spawn_server("--token-delay", "0.02") for _ in range(2)]
    victim_address, victim = servers[0]
    config = RolloutConfig(servers=[a for a, _ in servers], health=HEALTH, max_concurrent_rollouts=8,
                           consumer_batch_size=8, max_head_offpolicyness=0, request_deadline_s=60, workers=workers)
    with RolloutController(config) as ctl:
        for i in range(8):
            ctl.submit([i + 1], Generate(100))  # 2 s each on the wire
        server_log = victim_requests(victim_address)
        wait_until(lambda: server_log() >= 2, 20, "the victim gets requests")
        os.kill(victim.pid, signal.SIGSTOP)
        stopped = time.monotonic()
        try:
            trajs = ctl.wait(8, timeout=45)
            took = time.monotonic() - stopped
            metrics = ctl.step_metrics()
        finally:
            os.kill(victim.pid, signal.SIGCONT)
    assert took < 30, took  # eviction (interval x threshold + timeout), then 2 s on the other; deadline 60
    assert len(trajs) == 8
    for t in trajs:
        assert t.input_ids[1:] == chain(t.input_ids[0], 100, 1000)
    assert metrics["rollout/lost_total"] == 0 and metrics["rollout/resubmitted_total"] >= 2
    assert metrics["fleet/evicted_total"] == 1


def test_too_few_servers_hold_rollouts_back_then_fail_the_run(spawn_server):
    (address, proc), = [spawn_server()]
    config = RolloutConfig(servers=[address], health=HEALTH, min_servers=1, min_servers_grace_s=2.0)
    with RolloutController(config) as ctl:
        proc.kill()
        wait_until(lambda: not ctl.fleet.ready, 5, "the fleet is below min_servers")
        ctl.submit([5], Generate(4))
        began = time.monotonic()
        with pytest.raises(FleetTooSmall) as info:
            ctl.wait(1, timeout=30)
        waited = time.monotonic() - began
    assert "rollout.min_servers=1" in str(info.value) and address in str(info.value), info.value
    assert waited < 2.0 + HEALTH.interval_s * (HEALTH.failure_threshold + 2) + 2
    assert ctl.executor.stats()["submitted"] == 0  # no episode was started while too few were healthy

"""Weight updates that shrink: three real `tandem serve` processes behind a `RolloutController`
(the elastic fleet); one is SIGKILLed in a given phase of an update (announcing a broadcast
bucket, in the middle of its broadcast, staged before the commit, loading from disk). The update
completes on the two others within its deadline, their weights equal the trainer's, the dead one
is evicted, and the next update rebuilds the transfer group without it. The same fault through a
plain `HttpFleet` (a fixed list, nobody to evict the dead server) still fails the update."""

from __future__ import annotations

import signal
import time

import pytest

from tandem.fleet.http import HttpFleet
from tandem.fleet.ops import Deadlines
from tandem.rollout.config import RolloutConfig
from tandem.rollout.controller import RolloutController
from tandem.rollout.health import HealthConfig
from tandem.rollout.membership import MemberState
from tandem.weights.meta import WeightUpdateMeta
from tandem.weights.report import WeightSyncError
from tandem.weights.updater import WeightUpdater
from tests.inference.conftest import make_model_dir
from tests.weights.common import (
    BUCKET,
    FAST,
    CheckpointSource,
    Versions,
    expected_checksums,
    served_checksums,
    start_server,
    version_of,
)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("models"), "qwen3", seed=5)


@pytest.fixture(scope="module")
def pool(model_dir, tmp_path_factory):
    """Three servers; a test that kills one replaces it (`replace`)."""
    log_dir = tmp_path_factory.mktemp("serve")
    weights_dir = tmp_path_factory.getbasetemp()
    state = {"servers": [start_server(model_dir, log_dir, weights_dir) for _ in range(3)],
             "log_dir": log_dir, "weights_dir": weights_dir}
    yield state
    for s in state["servers"]:
        s.stop()


def replace_dead(pool, model_dir) -> None:
    for i, s in enumerate(pool["servers"]):
        if s.proc.poll() is not None:
            pool["servers"][i] = start_server(model_dir, pool["log_dir"], pool["weights_dir"])


def controller_over(servers) -> RolloutController:
    for s in servers:
        s.ok("/_fault", {"clear": True})
    config = RolloutConfig(servers=[s.url for s in servers], health=HealthConfig(interval_s=60.0, timeout_s=2.0))
    return RolloutController(config, deadlines=FAST)



def meta(kind: str, tmp_path) -> WeightUpdateMeta:
    return WeightUpdateMeta(type=kind, path=str(tmp_path / "versions") if kind == "disk" else None,
                            bucket_bytes=BUCKET, deadlines=FAST)


FAULTS = {
    "announce": ("distributed", {"route": "update_weights_from_distributed", "action": "kill", "nth": 3}),
    "broadcast": ("distributed", {"route": "update_weights_from_distributed", "action": "kill", "nth": 3,
                                  "after_tensors": 1}),
    "staged-before-commit": ("distributed", {"route": "commit_staged_weights", "action": "kill"}),
    "disk-load": ("disk", {"route": "update_weights_from_disk", "action": "kill"}),
    "shm-bucket": ("shm", {"route": "update_weights_from_shm", "action": "kill", "nth": 2}),
}


@pytest.mark.parametrize("phase", list(FAULTS))
def test_a_server_killed_in_a_phase_leaves_the_update_to_the_others(pool, model_dir, tmp_path, phase):
    replace_dead(pool, model_dir)
    kind, fault = FAULTS[phase]
    servers = list(pool["servers"])
    victim, survivors = servers[1], [servers[0], servers[2]]
    with controller_over(servers) as ctl:
        version = Versions.next()
        src = CheckpointSource(model_dir, scale=1.0 + version / 100)
        with WeightUpdater(src, ctl, meta(kind, tmp_path), verify=True) as updater:
            victim.ok("/_fault", fault)
            start = time.monotonic()
            report = updater.update(version)
            elapsed = time.monotonic() - start
            print(f"\n[{phase}] update on the survivors in {elapsed:.2f}s, {report.attempts} attempt(s), "
                  f"left out: {report.left_out}")
            assert elapsed < FAST.update_s
            assert victim.proc.wait(10) is not None
            assert set(report.servers) == {s.url for s in survivors}
            assert victim.url in report.left_out
            want = expected_checksums(src.tensors)
            for s in survivors:
                assert version_of(s) == str(version) and served_checksums(s) == want
            record = ctl.fleet.membership.record(victim.url)
            assert record is not None and record.state is MemberState.EVICTED, record
            assert ctl.fleet.stats()["fleet/evicted_total"] == 1.0
            assert ctl.fleet.stats()["fleet/healthy"] == 2.0
            assert ctl.version.value == version
            # The next update goes to the two survivors only, in a group (re)built without the dead one.
            version = Versions.next()
            src = CheckpointSource(model_dir, scale=1.0 + version / 100)
            updater.source = updater.transport.source = src
            report = updater.update(version)
            assert set(report.servers) == {s.url for s in survivors} and report.attempts == 1
            if kind == "distributed":
                assert updater.transport.members == [s.url for s in survivors]
            want = expected_checksums(src.tensors)
            for s in survivors:
                assert version_of(s) == str(version) and served_checksums(s) == want


def test_a_fixed_fleet_fails_the_update_instead(pool, model_dir, tmp_path):
    """Without an owner that evicts left-out servers, going on without one would leave it serving
    stale weights: the update fails, naming it, and the others keep their weights."""
    replace_dead(pool, model_dir)
    servers = list(pool["servers"])
    for s in servers:
        s.ok("/_fault", {"clear": True})
    victim = servers[1]
    before = {s.url: version_of(s) for s in servers}
    with HttpFleet([s.url for s in servers], deadlines=FAST) as fleet:
        version = Versions.next()
        with WeightUpdater(CheckpointSource(model_dir, scale=1.5), fleet, meta("distributed", tmp_path)) as updater:
            victim.ok("/_fault", FAULTS["announce"][1])
            with pytest.raises(WeightSyncError) as info:
                updater.update(version)
    assert victim.url in str(info.value)
    for s in (servers[0], servers[2]):
        assert version_of(s) == before[s.url]


def test_a_stopped_server_is_evicted_and_after_sigcont_rejoins_through_warm_up(pool, model_dir, tmp_path):
    """SIGSTOP: its probes time out and it is evicted; the next update goes to the two others.
    SIGCONT: it answers again, comes back as joining -> warming (never straight to healthy), and the
    next update warms it from disk (checksums compared with the checkpoint's), rebuilds the group
    with it, and admits it: its weights equal the trainer's."""
    replace_dead(pool, model_dir)
    servers = list(pool["servers"])
    victim = servers[1]
    for s in servers:
        s.ok("/_fault", {"clear": True})
    health = HealthConfig(interval_s=0.3, timeout_s=0.5, failure_threshold=2)
    config = RolloutConfig(servers=[s.url for s in servers], health=health, topology_cooldown_s=0.0)
    update_meta = WeightUpdateMeta(type="distributed", bucket_bytes=BUCKET, deadlines=FAST,
                                   warmup_dir=str(tmp_path / "weights"))
    with RolloutController(config, deadlines=FAST) as ctl, \
            WeightUpdater(CheckpointSource(model_dir, scale=1.1), ctl, update_meta, verify=True) as updater:
        updater.update(Versions.next())
        victim.proc.send_signal(signal.SIGSTOP)
        try:
            bound = health.interval_s * health.failure_threshold + health.timeout_s + 1.0
            evicted = wait_for_state(ctl, victim.url, MemberState.EVICTED, bound)
            print(f"\nstopped server evicted after {evicted:.2f}s (bound {bound:.1f}s)")
            version = Versions.next()
            report = updater.update(version)
            assert victim.url not in report.servers and len(report.servers) == 2
        finally:
            victim.proc.send_signal(signal.SIGCONT)
        wait_for_state(ctl, victim.url, MemberState.WARMING, 10.0)
        assert victim.url not in ctl.pool.addresses
        version = Versions.next()
        src = CheckpointSource(model_dir, scale=1.0 + version / 100)
        updater.source = updater.transport.source = src
        report = updater.update(version)
        assert report.warmed == (victim.url,) and set(report.servers) == {s.url for s in servers}
        assert ctl.fleet.membership.record(victim.url).state is MemberState.HEALTHY
        assert victim.url in ctl.pool.addresses and ctl.fleet.stats()["fleet/joined_total"] == 1
        assert updater.transport.members == [servers[0].url, servers[2].url, victim.url]
        want = expected_checksums(src.tensors)
        for s in servers:
            assert version_of(s) == str(version) and served_checksums(s) == want
        assert not (tmp_path / "weights" / f"warmup-v{version:08d}").exists()  # the warm-up copy is gone


# Deadlines far longer than eviction takes: an update that waited on the stopped server would
# take one of them (>= 30 s) instead of finishing at its eviction.
PATIENT = Deadlines(init_group_s=30.0, bucket_s=30.0, update_s=120.0, http_s=30.0)
STOPS = {  # phase -> (transport, the fault that SIGSTOPs the victim there; None: stopped before the update)
    "pause": ("shm", None),
    "join-group": ("distributed", {"route": "init_weights_update_group", "action": "stop"}),
    "broadcast": ("distributed", {"route": "update_weights_from_distributed", "action": "stop", "nth": 3}),
    # The last server (group rank 3): gloo's broadcast reaches rank 1 through it, so rank 1 stays
    # blocked in its receive after the eviction; the retry must not wait for that receive to end.
    "broadcast-relay": ("distributed", {"route": "update_weights_from_distributed", "action": "stop", "nth": 3}),
    "commit": ("distributed", {"route": "commit_staged_weights", "action": "stop"}),
    "disk-load": ("disk", {"route": "update_weights_from_disk", "action": "stop"}),
    "shm-bucket": ("shm", {"route": "update_weights_from_shm", "action": "stop", "nth": 2}),
}


@pytest.mark.parametrize("phase", list(STOPS))
def test_a_server_stopped_in_an_update_is_given_up_at_its_eviction(pool, model_dir, tmp_path, phase):
    """A member SIGSTOPped in a phase of an update (a hung host, a partition): the health monitor
    evicts it within interval x threshold + timeout, and every call of the update still waiting on
    it is given up then, so the update finishes on the others within that bound plus its own time,
    not after a deadline of 30 s. Trainer rank 0 reaches the fleet through the controller's
    callback, as in a run; the stopped server is left out and evicted, the others serve the new
    weights."""
    replace_dead(pool, model_dir)
    kind, fault = STOPS[phase]
    servers = list(pool["servers"])
    index = 2 if phase == "broadcast-relay" else 1
    victim, survivors = servers[index], [s for i, s in enumerate(servers) if i != index]
    for s in servers:
        s.ok("/_fault", {"clear": True})
    health = HealthConfig(interval_s=0.3, timeout_s=0.5, failure_threshold=2)
    config = RolloutConfig(servers=[s.url for s in servers], health=health)
    update_meta = WeightUpdateMeta(type=kind, path=str(tmp_path / "versions") if kind == "disk" else None,
                                   bucket_bytes=BUCKET, deadlines=PATIENT)
    detection = health.interval_s * health.failure_threshold + health.timeout_s
    try:
        with RolloutController(config, deadlines=PATIENT) as ctl:
            callback = ctl.callback()
            version = Versions.next()
            src = CheckpointSource(model_dir, scale=1.0 + version / 100)
            with WeightUpdater(src, callback, update_meta, verify=True) as updater:
                if fault is None:
                    victim.proc.send_signal(signal.SIGSTOP)
                else:
                    victim.ok("/_fault", fault)
                start = time.monotonic()
                report = updater.update(version)
                elapsed = time.monotonic() - start
            callback.close()
            print(f"\n[{phase}] update in {elapsed:.2f}s (detection bound {detection:.1f}s), "
                  f"{report.attempts} attempt(s), left out: {report.left_out}")
            assert elapsed < detection + 6.0, f"the update waited on the stopped server: {elapsed:.1f}s"
            assert set(report.servers) == {s.url for s in survivors} and victim.url in report.left_out
            record = ctl.fleet.membership.record(victim.url)
            assert record is not None and record.state is MemberState.EVICTED, record
            want = expected_checksums(src.tensors)
            for s in survivors:
                assert version_of(s) == str(version) and served_checksums(s) == want
    finally:
        victim.proc.send_signal(signal.SIGCONT)
        victim.proc.kill()  # mid-update state (a half-formed group) would slow the next test down
        victim.proc.wait(10)


def wait_for_state(ctl: RolloutController, address: str, state: MemberState, timeout: float) -> float:
    start = time.monotonic()
    while ctl.fleet.membership.record(address).state is not state:
        assert time.monotonic() - start < timeout, f"{address} not {state.value} within {timeout}s: " \
                                                   f"{ctl.fleet.membership.record(address)}"
        time.sleep(0.05)
    return time.monotonic() - start


class CollectiveSource(CheckpointSource):
    """A checkpoint whose export is a collective, like a sharded engine's gathers: every bucket
    is an all-reduce across the trainer ranks, so ranks that disagreed on how many attempts an
    update takes would hang instead of passing."""

    def __init__(self, model_dir, scale):
        super().__init__(model_dir, scale)
        self.exports = 0

    def export_weights(self, bucket_bytes, dtype=None, alloc=None, dst=None):
        import torch
        import torch.distributed as dist

        self.exports += 1
        for bucket in super().export_weights(bucket_bytes, dtype, alloc, dst):
            dist.all_reduce(torch.ones(1))
            yield bucket


def _update_on_two_ranks(rank: int, world_size: int, model_dir: str, callback_env: dict, version: int) -> dict:
    from tandem.rollout.callback import RolloutCallback

    fleet = RolloutCallback.from_env(callback_env) if rank == 0 else None
    source = CollectiveSource(model_dir, scale=1.0 + version / 100)
    meta = WeightUpdateMeta(type="distributed", bucket_bytes=BUCKET, deadlines=FAST)
    with WeightUpdater(source, fleet, meta) as updater:
        report = updater.update(version)
    return {"attempts": report.attempts, "servers": report.servers, "left_out": sorted(report.left_out),
            "exports": source.exports}


def test_two_trainer_ranks_take_rank_0s_decisions(pool, model_dir):
    """Only trainer rank 0 talks to the fleet, so only it sees a server die in the middle of a
    broadcast; rank 1 still makes the same second attempt (its export's collectives run again), and
    both ranks report the same servers, the same left-out server and the same number of attempts."""
    from tests.distributed import run_distributed

    replace_dead(pool, model_dir)
    servers = list(pool["servers"])
    victim = servers[2]
    with controller_over(servers) as ctl:
        victim.ok("/_fault", FAULTS["broadcast"][1])
        version = Versions.next()
        ranks = run_distributed(_update_on_two_ranks, 2, args=(str(model_dir), ctl.callback().env(), version),
                                timeout=120)
    print(f"\nrank 0: {ranks[0]}\nrank 1: {ranks[1]}")
    assert ranks[0] == ranks[1]
    assert ranks[0]["attempts"] == 2 and ranks[0]["exports"] == 2
    assert ranks[0]["left_out"] == [victim.url] and set(ranks[0]["servers"]) == {servers[0].url, servers[1].url}
    want = expected_checksums(CheckpointSource(model_dir, scale=1.0 + version / 100).tensors)
    for s in servers[:2]:
        assert version_of(s) == str(version) and served_checksums(s) == want

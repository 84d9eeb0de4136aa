"""Weight updates against two real `tandem serve` processes with injected faults: a server answering
500, one that never joins the group, a wrong shape, one killed mid-broadcast, a shm bucket refused,
one holding a corrupted tensor after the commit (caught by verify).
Each update ends within its deadline with an error naming the server and the phase, the servers
keep the previous weights and version, nothing is left in /dev/shm (servers serve zero-copy from
the segments of the update they committed, never from one being written), and a retry succeeds. Also:
requests in flight during an update are aborted and their resubmission continues under the new
version inside one trajectory."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import pytest
import torch

from tandem.fleet import ops
from tandem.fleet.generation import GenerationParams
from tandem.fleet.http import HttpFleet
from tandem.rollout.client import ClientConfig, InferenceClient
from tandem.rollout.types import ModelRequest
from tandem.weights.meta import WeightUpdateMeta
from tandem.weights.report import WeightSyncError
from tandem.weights.updater import WeightUpdater
from tests.inference.conftest import make_model_dir
from tests.inference.server_utils import wait_for
from tests.weights.common import (
    BUCKET,
    FAST,
    CheckpointSource,
    Versions,
    assert_serves,
    expected_checksums,
    mapped_names,
    served_checksums,
    served_set,
    shm_leftovers,
    start_server,
    version_of,
)

pytestmark = pytest.mark.slow
Q = "model.layers.1.self_attn.q_proj.weight"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("models"), "qwen3", seed=3)


@pytest.fixture(scope="module")
def servers(model_dir, tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("serve")
    weights_dir = tmp_path_factory.getbasetemp()  # disk updates write below each test's tmp_path
    pool = [start_server(model_dir, log_dir, weights_dir), start_server(model_dir, log_dir, weights_dir)]
    pool_info = {"servers": pool, "log_dir": log_dir, "weights_dir": weights_dir}
    yield pool_info
    for s in pool_info["servers"]:
        s.stop()


@pytest.fixture
def fleet(servers):
    for s in servers["servers"]:
        s.ok("/_fault", {"clear": True})
    f = HttpFleet([s.url for s in servers["servers"]], deadlines=FAST)
    yield f
    f.close()



def meta(kind: str, tmp_path=None) -> WeightUpdateMeta:
    return WeightUpdateMeta(type=kind, path=str(tmp_path) if tmp_path else None, bucket_bytes=BUCKET,
                            deadlines=FAST)


def good_update(model_dir, fleet, kind="distributed", tmp_path=None) -> tuple[int, CheckpointSource]:
    version = Versions.next()
    src = CheckpointSource(model_dir, scale=1.0 + version / 100)
    with WeightUpdater(src, fleet, meta(kind, tmp_path), verify=True) as u:
        report = u.update(version)
    assert report.verified and (report.buckets >= 5 or kind == "disk") and report.bytes > 400_000
    return version, src


def assert_unchanged(servers, version: int, src: CheckpointSource) -> None:
    """Every server holds `src`'s weights as `version`: by checksum, and tensor by tensor read back
    whole (a failed update that left half-written weights behind fails it even if the checksums lied)."""
    want = expected_checksums(src.tensors)
    for s in servers:
        assert version_of(s) == str(version)
        assert served_checksums(s) == want
        assert_serves(s, src.tensors, s.url)
        assert s.get("/health")[0] == 200
        assert s.ok("/get_server_info", method="GET")["paused"] is False  # generation goes on, failure or not


def failing_update(updater: WeightUpdater, version: int, bound_s: float) -> WeightSyncError:
    start = time.monotonic()
    with pytest.raises(WeightSyncError) as info:
        updater.update(version)
    elapsed = time.monotonic() - start
    assert elapsed < bound_s, f"the failing update took {elapsed:.1f}s (bound {bound_s}s): {info.value}"
    print(f"\n[failed in {elapsed:.2f}s, bound {bound_s:.0f}s] {info.value}")
    return info.value


def test_server_answering_500(servers, fleet, model_dir):
    a, b = servers["servers"]
    old, old_src = good_update(model_dir, fleet)
    b.ok("/_fault", {"route": "update_weights_from_distributed", "action": "500", "nth": 3})
    version = Versions.next()
    src = CheckpointSource(model_dir, scale=1.0 + version / 100)
    with WeightUpdater(src, fleet, meta("distributed"), verify=True) as u:
        err = failing_update(u, version, bound_s=3 * FAST.bucket_s + 5)
        assert err.phase == "stage_distributed (bucket 2)", err
        assert b.url in str(err) and "HTTP 500" in str(err) and a.url not in str(err), err
        assert_unchanged(servers["servers"], old, old_src)
        u.update(version)  # the retry forms a fresh group and succeeds
    assert_unchanged(servers["servers"], version, src)


def test_server_never_joins(servers, fleet, model_dir):
    _, b = servers["servers"]
    old, old_src = good_update(model_dir, fleet)
    b.ok("/_fault", {"route": "init_weights_update_group", "action": "hang", "seconds": FAST.init_group_s + 2})
    version = Versions.next()
    src = CheckpointSource(model_dir, scale=1.0 + version / 100)
    with WeightUpdater(src, fleet, meta("distributed")) as u:
        err = failing_update(u, version, bound_s=2 * FAST.init_group_s + 5)
        assert err.phase == "join_group", err
        assert f"{b.url}: no answer within" in str(err), err
        assert_unchanged(servers["servers"], old, old_src)
        u.update(version)
    assert_unchanged(servers["servers"], version, src)


def test_wrong_shape(servers, fleet, model_dir):
    old, old_src = good_update(model_dir, fleet)
    version = Versions.next()
    bad = CheckpointSource(model_dir, scale=1.0 + version / 100, break_shape=Q)
    with WeightUpdater(bad, fleet, meta("distributed")) as u:
        err = failing_update(u, version, bound_s=FAST.bucket_s + 5)
        assert err.phase.startswith("stage_distributed (bucket "), err
        assert "has shape" in str(err) and Q in str(err), err
        assert all(s.url in str(err) for s in servers["servers"]), err
        assert_unchanged(servers["servers"], old, old_src)
        good = CheckpointSource(model_dir, scale=1.0 + version / 100)
        u.transport.source = good
        u.update(version)
    assert_unchanged(servers["servers"], version, good)


def test_shm_refused_then_retry_and_no_leaks(servers, fleet, model_dir):
    a, b = servers["servers"]
    old, old_src = good_update(model_dir, fleet, "shm")
    # Zero-copy: both servers serve from the segments of the committed update (unlinked when its
    # updater closed; the mappings keep them alive).
    served = served_set([a, b])
    assert shm_leftovers() == [] and len(served) >= 5
    a.ok("/_fault", {"route": "update_weights_from_shm", "action": "500", "nth": 2})
    version = Versions.next()
    src = CheckpointSource(model_dir, scale=1.0 + version / 100)
    with WeightUpdater(src, fleet, meta("shm")) as u:
        err = failing_update(u, version, bound_s=FAST.bucket_s + 5)
        assert err.phase == "stage_shm (bucket 1)" and a.url in str(err), err
        assert_unchanged(servers["servers"], old, old_src)
        # The failed update's segments are gone and mapped by nobody; the old ones still serve.
        assert shm_leftovers() == [] and mapped_names(a.pid) == served == mapped_names(b.pid)
        u.update(version)
        live = set(shm_leftovers())
        assert len(live) >= 5 and served_set([a, b]) == live
    assert_unchanged(servers["servers"], version, src)
    assert shm_leftovers() == [] and mapped_names(a.pid) == live == mapped_names(b.pid)
    # Ping-pong: updates write two sets of segments in turn, kept between updates (shm_reuse); the
    # servers map the set of the last committed update only, never the one the next update writes.
    # This engine does not tell its size: the first update takes a segment per bucket, every later
    # one a single segment holding the whole update (the size learnt), reused from then on.
    with WeightUpdater(src, fleet, meta("shm"), shm_reuse=True) as u:
        sets = []
        for _ in range(5):
            version = Versions.next()
            src = CheckpointSource(model_dir, scale=1.0 + version / 100)
            u.transport.source = src
            u.update(version)
            now = served_set([a, b])
            assert now <= set(shm_leftovers())
            assert_unchanged(servers["servers"], version, src)
            assert not sets or now.isdisjoint(sets[-1])
            sets.append(now)
        assert len(sets[0]) >= 5 and [len(x) for x in sets[1:]] == [1, 1, 1, 1]
        assert sets[3] == sets[1] and sets[4] == sets[2]
        assert set(shm_leftovers()) == sets[3] | sets[4]
    assert shm_leftovers() == []


def test_serving_from_shm_never_writes_the_trainers_segments(servers, fleet, model_dir, tmp_path):
    """A server serving zero-copy maps the segments copy-on-write: an in-place write to its
    parameters (a disk update copies into them) lands in its own pages, not the trainer's."""
    a, b = servers["servers"]
    version = Versions.next()
    src = CheckpointSource(model_dir, scale=1.0 + version / 100)
    with WeightUpdater(src, fleet, meta("shm"), shm_reuse=True) as u:
        u.update(version)
        live = sorted(shm_leftovers())
        assert set(live) == served_set([a, b])
        before = {name: Path("/dev/shm", name).read_bytes() for name in live}
        disk_version, disk_src = good_update(model_dir, fleet, "disk", tmp_path)
        assert_unchanged(servers["servers"], disk_version, disk_src)
        assert {name: Path("/dev/shm", name).read_bytes() for name in live} == before
        assert not mapped_names(a.pid) and not mapped_names(b.pid)  # the disk copy replaced the views


def test_disk_refused_then_retry(servers, fleet, model_dir, tmp_path):
    a, b = servers["servers"]
    old, _ = good_update(model_dir, fleet, "disk", tmp_path)
    b.ok("/_fault", {"route": "commit_staged_weights", "action": "500"})
    version = Versions.next()
    src = CheckpointSource(model_dir, scale=1.0 + version / 100)
    with WeightUpdater(src, fleet, meta("disk", tmp_path)) as u:
        err = failing_update(u, version, bound_s=FAST.http_s + 5)
        assert err.phase == "commit" and b.url in str(err), err
        # a committed, b refused: a commit failure is the one case that leaves the fleet mixed
        assert version_of(a) == str(version) and version_of(b) == str(old)
        assert sorted(p.name for p in tmp_path.iterdir()) == [f"v{old:08d}"]  # the failed copy is gone
        u.update(version)
    assert_unchanged(servers["servers"], version, src)
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"v{version:08d}"]  # older copies removed


def test_a_server_holding_one_corrupted_tensor_fails_verify(servers, fleet, model_dir, tmp_path):
    """Catches a verify that passes whatever the servers hold (or checks the trainer against itself,
    or blames the wrong server): after the commit and before verify, server b's copy of one tensor
    is changed in one element by one ulp (b loads the update's tensors from a checkpoint holding that
    one change); the update fails in phase `verify` naming b, that tensor, and not a. The same
    update without the change then verifies."""
    a, b = servers["servers"]
    version = Versions.next()
    src = CheckpointSource(model_dir, scale=1.0 + version / 100)
    corrupt = CheckpointSource(model_dir, scale=1.0 + version / 100)
    flat = corrupt.tensors[Q].view(-1)
    flat[7] = torch.nextafter(flat[7], torch.tensor(float("inf")))
    corrupt_dir = corrupt.save_hf(tmp_path / "corrupt")
    real_send = fleet.send

    def send(op, request, targets=None):
        sent = real_send(op, request, targets)
        if op is ops.COMMIT:  # both servers now hold the update; b's copy of Q goes wrong
            sent.result()
            b.ok("/update_weights_from_disk", {"model_path": str(corrupt_dir)})
        return sent

    fleet.send = send
    with WeightUpdater(src, fleet, meta("distributed"), verify=True) as u:
        err = failing_update(u, version, bound_s=FAST.update_s)
    assert err.phase == "verify", err
    assert [f.address for f in err.failures] == [b.url] and a.url not in str(err), err
    assert f"1 tensor(s) differ from the trainer's, e.g. ['{Q}']" in str(err), err
    # The premise: b differs from the trainer in that one tensor only, a in none.
    want = expected_checksums(src.tensors)
    assert served_checksums(a) == want
    assert sorted(n for n, c in served_checksums(b).items() if want[n] != c) == [Q]
    fleet.send = real_send
    version = Versions.next()
    src = CheckpointSource(model_dir, scale=1.0 + version / 100)
    with WeightUpdater(src, fleet, meta("distributed"), verify=True) as u:
        assert u.update(version).verified
    assert_unchanged(servers["servers"], version, src)


def test_inflight_requests_resume_under_new_version(servers, fleet, model_dir):
    a, _ = servers["servers"]
    old, _ = good_update(model_dir, fleet, "shm")
    client = InferenceClient([a.url], ClientConfig(deadline_s=60))
    req = ModelRequest(input_ids=[11, 57, 200, 31], params=GenerationParams(max_new_tokens=600, temperature=0.0,
                                                                            ignore_eos=True))
    result = {}

    def run():
        async def go():
            try:
                return await client.agenerate(req)
            finally:
                await client.aclose()
        result["response"] = asyncio.run(go())

    thread = threading.Thread(target=run)
    thread.start()
    stats = lambda: a.ok("/get_server_info", method="GET")["engine_stats"]  # noqa: E731
    wait_for(lambda: stats()["running"] > 0, timeout=30, interval=0.01)
    version, _ = good_update(model_dir, fleet, "shm")
    thread.join(60)
    resp = result["response"]
    assert resp.num_aborts >= 1 and len(resp.output_ids) == 600, resp
    switch = resp.output_versions.index(version)
    assert switch > 0 and set(resp.output_versions[:switch]) == {old}, resp.output_versions
    assert set(resp.output_versions[switch:]) == {version}


def test_server_killed_mid_broadcast(servers, fleet, model_dir):
    a, b = servers["servers"]
    old, old_src = good_update(model_dir, fleet)
    b.ok("/_fault", {"route": "update_weights_from_distributed", "action": "kill", "nth": 2, "after_tensors": 1})
    version = Versions.next()
    src = CheckpointSource(model_dir, scale=1.0 + version / 100)
    with WeightUpdater(src, fleet, meta("distributed")) as u:
        err = failing_update(u, version, bound_s=2 * FAST.bucket_s + 10)
        assert err.phase.startswith("stage_distributed (bucket 1)"), err
        assert b.url in str(err), err
        b.proc.wait(10)
        assert b.proc.returncode is not None
        assert_unchanged([a], old, old_src)
    # The dead server is replaced; the retry reaches the whole fleet again.
    b2 = start_server(model_dir, servers["log_dir"], servers["weights_dir"])
    servers["servers"][1] = b2
    with HttpFleet([a.url, b2.url], deadlines=FAST) as fleet2, \
            WeightUpdater(src, fleet2, meta("distributed"), verify=True) as u:
        u.update(version)
    assert_unchanged([a, b2], version, src)

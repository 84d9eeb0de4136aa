"""The data plane's fast paths: flat buckets (one broadcast per bucket) into the server's ping-pong
staging buffers, the per-tensor fallback for fleets that only speak the SGLang protocol, the
trainer's packing, kept-alive HTTP connections to `tandem serve` (TCP_NODELAY), and every tensor
delivered bit for bit by each transport (read back whole, not compared by checksum)."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import Future

import aiohttp
import pytest
import torch

from tandem.fleet import ops
from tandem.fleet.adapters import TandemAdapter
from tandem.fleet.http import HttpFleet
from tandem.fleet.interface import call
from tandem.inference.server.app import bind
from tandem.models import load_model
from tandem.models.tiny import init_model
from tandem.train.weight_export import iter_weight_buckets
from tandem.weights.meta import WeightUpdateMeta
from tandem.weights.packing import plan_buckets
from tandem.weights.report import WeightSyncError
from tandem.weights.shm import ShmError, ShmWriter, layout, map_segment, pack, tensor_views
from tandem.weights.updater import WeightUpdater
from tests.inference.conftest import make_model_dir
from tests.launch.procs import CHILD_ENV, REPO, SHM, Marked
from tests.weights.common import (
    FAST,
    CheckpointSource,
    assert_serves,
    expected_checksums,
    served_checksums,
    start_server,
    version_of,
)

BUCKET = 48 * 1024


# ------------------------------------------------------------------------------ no server needed
def test_bind_sets_tcp_nodelay():
    """The listening socket is a TCP socket (proto IPPROTO_TCP, so asyncio sets TCP_NODELAY on every
    accepted connection) with TCP_NODELAY itself; an accepted socket has both too."""
    sock = bind("127.0.0.1", 0)
    try:
        assert sock.proto == socket.IPPROTO_TCP
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
        client = socket.create_connection(sock.getsockname()[:2])
        accepted, _ = sock.accept()
        try:
            assert accepted.proto == socket.IPPROTO_TCP
            assert accepted.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
        finally:
            accepted.close()
            client.close()
    finally:
        sock.close()


def test_pack_casts_into_the_flat_buffer():
    tensors = [torch.randn(3, 5), torch.randn(7), torch.randn(2, 2, 2)]
    offsets, nbytes = layout(tensors, torch.bfloat16)
    assert all(o % 64 == 0 for o in offsets) and nbytes == offsets[-1] + 8 * 2
    buf = torch.zeros(nbytes, dtype=torch.uint8)
    views = pack(buf, tensors, offsets, torch.bfloat16)
    again = tensor_views(buf, offsets, [t.shape for t in tensors], [torch.bfloat16] * 3)
    for t, v, w in zip(tensors, views, again, strict=True):
        assert v.data_ptr() == w.data_ptr() and torch.equal(v, t.to(torch.bfloat16))


def test_shm_writer_puts_an_update_in_one_segment_announced_in_windows():
    """Buckets go back to back into one segment (sized by `expected`, or learnt from the last pass);
    a window of several buckets maps and reads back exactly; a kept segment is reused."""
    torch.manual_seed(0)
    buckets = [[torch.randn(300, 7), torch.randn(5)], [torch.randn(1000)], [torch.randn(64, 64)]]
    writer = ShmWriter()
    try:
        packs = []
        for b in buckets:  # no size known: a segment per bucket
            name, offsets, nbytes, views = writer.write(b, torch.bfloat16)
            packs.append((name, offsets, nbytes))
            del views
        assert len({p[0] for p in packs}) == 3 and len(writer.paths) == 3
        used = writer.used
        writer.rewind()  # consolidated into one segment of the size learnt
        assert writer.paths == []
        packs = [writer.write(b, torch.bfloat16)[:3] for b in buckets]
        assert len({p[0] for p in packs}) == 1 and len(writer.paths) == 1 and writer.used == used
        first_path = writer.paths[0]
        # buckets 1 and 2 as one window: map only the bytes they span
        specs = [t for b in buckets[1:] for t in b]
        offsets = [o for p in packs[1:] for o in p[1]]
        mapped, base = map_segment(packs[0][0], packs[0][2], start=min(offsets), end=packs[0][2])
        assert base <= min(offsets) and mapped.numel() == packs[0][2] - base
        got = tensor_views(mapped, [o - base for o in offsets], [t.shape for t in specs], [torch.bfloat16] * 2)
        for g, t in zip(got, specs, strict=True):
            assert torch.equal(g, t.to(torch.bfloat16))
        del got, mapped
        writer.rewind(expected=1)  # a smaller guess never shrinks what the last pass needed
        writer.write(buckets[0], torch.bfloat16)
        assert writer.paths == [first_path]
        with pytest.raises(ShmError, match="not inside"):
            map_segment(packs[0][0], packs[0][2], start=0, end=packs[0][2] + 1)
    finally:
        writer.close()
    assert not first_path.exists()


_KEEP_A_SEGMENT = """
import time, torch
from tandem.weights.shm import ShmWriter
writer = ShmWriter()
writer.write([torch.ones(1000)])
first = writer.paths[0].name
writer.rewind(expected=1)
writer.write([torch.ones(10**6)])  # too big for the kept segment: it is replaced (unlinked, untracked)
print(first, writer.paths[0].name, flush=True)
time.sleep(600)
"""


@pytest.mark.timeout(60)
def test_segments_of_a_killed_writer_are_unlinked(tmp_path):
    """A trainer SIGKILLed with its segments open (e.g. by the parent-death signal when its
    controller dies) leaves none behind: each segment is registered with the trainer's resource
    tracker before it is created, and the tracker unlinks it once the trainer is gone. A segment
    the writer removed itself is no longer registered (the tracker does not try it again)."""
    marked = Marked()
    with open(tmp_path / "stderr", "wb") as err:
        proc = subprocess.Popen([sys.executable, "-c", _KEEP_A_SEGMENT], cwd=REPO, stdout=subprocess.PIPE, stderr=err,
                                env={**os.environ, **CHILD_ENV, **marked.env}, start_new_session=True)
    try:
        replaced, name = proc.stdout.readline().decode().split()
        assert not (SHM / replaced).exists() and (SHM / name).exists()
        marked.scan()
        proc.kill()
        proc.wait()
        left, objects, took = marked.wait_gone(5.0)
        print(f"SIGKILL of a writer: {len(objects)} segments left {took:.2f}s later")
        assert not left and not (SHM / name).exists(), marked.describe(left, objects)
        assert replaced not in (tmp_path / "stderr").read_text()  # what the tracker says: only the kept one
    finally:
        proc.kill()
        proc.wait()
        marked.clean_up()


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe"])
def test_plan_buckets_match_the_engine_export(tmp_path, arch):
    """The single-process fast path (uncast parameters, cast while packing) cuts the same buckets
    as `iter_weight_buckets` in the wire dtype (MoE: a stacked expert parameter's HF pieces
    travel together in both)."""
    model = load_model(init_model(tmp_path / "m", arch=arch, preset="tiny"))
    from tandem.train.weight_export import local_parameters

    params = local_parameters(model)
    for bucket_bytes in (1, 10_000, 48 * 1024, 10**9):
        ours = [[n for n, _ in b] for b in plan_buckets(params, bucket_bytes, torch.bfloat16)]
        theirs = [[n for n, _ in b] for b in iter_weight_buckets(model, bucket_bytes, torch.bfloat16)]
        assert ours == theirs


# ---------------------------------------------------------------------------------- one server
@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("models"), "qwen3", seed=5)


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    # Disk updates write below each test's tmp_path.
    s = start_server(model_dir, tmp_path_factory.mktemp("serve"), tmp_path_factory.getbasetemp())
    yield s
    s.stop()


@pytest.mark.slow
def test_kept_alive_calls(server):
    """20 sequential calls on ONE kept-alive connection all succeed (before the TCP_NODELAY fix each
    took ~40 ms: the reply's body waited for the client's delayed ACK)."""

    async def run() -> tuple[list[float], int]:
        created = 0

        async def on_create(session, ctx, params):
            nonlocal created
            created += 1

        trace = aiohttp.TraceConfig()
        trace.on_connection_create_end.append(on_create)
        latencies = []
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1), trace_configs=[trace]) as session:
            for i in range(20):
                start = time.perf_counter()
                async with session.post(server.url + "/update_weight_version", json={"new_version": str(i)}) as r:
                    assert r.status == 200, await r.text()
                    await r.read()
                latencies.append(time.perf_counter() - start)
        return latencies, created

    latencies, created = asyncio.run(run())
    ms = sorted(x * 1e3 for x in latencies)
    print(f"\n[kept-alive /update_weight_version] median {ms[len(ms) // 2]:.2f} ms, max {ms[-1]:.2f} ms, "
          f"{created} connection(s)")
    assert created == 1
    assert version_of(server) == "19"


def _update(model_dir, fleet, version: int, **kw) -> CheckpointSource:
    src = CheckpointSource(model_dir, scale=1.0 + version / 100)
    meta = WeightUpdateMeta(type="distributed", bucket_bytes=BUCKET, deadlines=FAST)
    with WeightUpdater(src, fleet, meta, verify=True, **kw) as u:
        report = u.update(version)
    assert report.verified and report.buckets >= 5
    return src


@pytest.mark.slow
def test_ping_pong_staging_keeps_atomicity(server, model_dir):
    """Flat buckets, five updates: the server's staging buffers and live weights trade places at each
    commit; a failed update in between (after the buffers have swapped twice) leaves the live
    weights and version exactly as they were, and the next update lands exactly."""
    server.ok("/_fault", {"clear": True})
    with HttpFleet([server.url], deadlines=FAST) as fleet:
        assert fleet.capabilities.flat_buckets
        for version in (101, 102, 103):
            src = _update(model_dir, fleet, version)
            assert served_checksums(server) == expected_checksums(src.tensors)
        server.ok("/_fault", {"route": "update_weights_from_distributed", "action": "500", "nth": 3})
        with pytest.raises(WeightSyncError) as info:
            _update(model_dir, fleet, 104)
        assert "bucket 2" in info.value.phase
        assert version_of(server) == "103" and served_checksums(server) == expected_checksums(src.tensors)
        server.ok("/_fault", {"clear": True})
        for version in (105, 106):
            src = _update(model_dir, fleet, version)
            assert version_of(server) == str(version)
            assert served_checksums(server) == expected_checksums(src.tensors)


@pytest.mark.slow
@pytest.mark.parametrize(("kind", "version"), [("disk", 401), ("distributed", 402), ("shm", 403)])
def test_each_transport_delivers_every_tensor_bit_exact(server, model_dir, tmp_path, kind, version):
    """Catches a transport that delivers other bytes than the trainer sent (a wrong offset or
    length in a flat bucket or segment, a lossy cast, a tensor left stale) even where the product's
    own checksum would agree with it (the trainer's and the server's checksum share
    `tensor_checksum`, so a bug there hides a bad transfer from verify and from the tests that
    compare checksums): verify is off, and every tensor the server serves after the update, read
    back whole, is torch.equal to the trainer's."""
    server.ok("/_fault", {"clear": True})
    src = CheckpointSource(model_dir, scale=1.0 + version / 1000)  # differs from what the server held
    meta = WeightUpdateMeta(type=kind, path=str(tmp_path) if kind == "disk" else None, bucket_bytes=BUCKET,
                            deadlines=FAST)
    with HttpFleet([server.url], deadlines=FAST) as fleet, WeightUpdater(src, fleet, meta, verify=False) as u:
        report = u.update(version)
    assert not report.verified and version_of(server) == str(version)
    assert kind == "disk" or report.buckets >= 5, report
    assert_serves(server, src.tensors, kind)


class _NoFlatBuckets(TandemAdapter):
    """A tandem server as seen by a fleet that sends one broadcast per tensor (SGLang's way)."""

    capabilities = dataclasses.replace(TandemAdapter.capabilities, flat_buckets=False)


@pytest.mark.slow
def test_per_tensor_broadcast_for_fleets_without_flat_buckets(server, model_dir):
    server.ok("/_fault", {"clear": True})
    with HttpFleet([server.url], adapter=_NoFlatBuckets(), deadlines=FAST) as fleet:
        for version, pipeline in ((201, True), (202, False)):
            src = _update(model_dir, fleet, version, pipeline=pipeline)
            assert served_checksums(server) == expected_checksums(src.tensors)


def test_swap_weights_adopts_only_a_whole_marked_set(tmp_path):
    from tandem.inference.weight_swap import ADOPTED, mark_adoptable, stage_weights, swap_weights
    from tandem.train.weight_export import hf_parameter_names

    model = load_model(init_model(tmp_path / "m", arch="qwen3", preset="tiny"))
    names = [(hf, p) for _, [(hf, _)], p in hf_parameter_names(model)]  # dense: one HF tensor each
    new = [(hf, torch.randn_like(p)) for hf, p in names]
    # One tensor unmarked: everything is copied in place, nothing adopted.
    for _, t in new[1:]:
        mark_adoptable(t)
    ptrs = [p.data_ptr() for _, p in names]
    assert not swap_weights(model, stage_weights(model, new))
    assert [p.data_ptr() for _, p in names] == ptrs and not any(getattr(t, ADOPTED, False) for _, t in new)
    assert all(torch.equal(p, t) for (_, p), (_, t) in zip(names, new, strict=True))
    # All marked: the parameters are rebound to the staged tensors (no copy).
    newer = [(hf, mark_adoptable(torch.randn_like(p))) for hf, p in names]
    assert swap_weights(model, stage_weights(model, newer))
    assert all(p.data_ptr() == t.data_ptr() and getattr(t, ADOPTED) for (_, p), (_, t) in zip(names, newer,
                                                                                               strict=True))


@pytest.mark.slow
def test_an_unverified_commit_announces_the_version(server, model_dir):
    """With nothing checked after the commit (no verifier) and a commit that sets the version, the
    commit announces it (`CommitStaged.announce`) and no `set_version` call follows: one round trip
    less per update; and tandem serve aborting in-flight requests at its commit
    (`CommitStaged.abort_all`), no pause and no continue either. With a verifier, the servers are
    paused around the commit and `set_version` comes after the checksums."""
    server.ok("/_fault", {"clear": True})
    with HttpFleet([server.url], deadlines=FAST) as fleet:
        sent: list[tuple[str, object]] = []
        real = fleet.send
        fleet.send = lambda op, request, targets=None: sent.append((op.name, request)) or real(op, request, targets)
        for verify, version in ((False, 401), (True, 402)):
            sent.clear()
            meta = WeightUpdateMeta(type="distributed", bucket_bytes=BUCKET, deadlines=FAST)
            with WeightUpdater(CheckpointSource(model_dir, scale=1.0 + version / 1000), fleet, meta,
                               verify=verify) as updater:
                updater.update(version)
            names = [name for name, _ in sent]
            commit = next(request for name, request in sent if name == "commit")
            assert commit == ops.CommitStaged(version, announce=not verify, abort_all=not verify)
            if verify:  # (the verifier reads checksums before the transfer too)
                after = names[names.index("commit"):]
                assert after.index("checksums") < after.index("set_version") < after.index("continue_generation"), names
                assert names.index("pause_generation") < names.index("commit"), names
            else:
                assert not {"set_version", "pause_generation", "continue_generation"} & set(names), names
            assert version_of(server) == str(version)


@pytest.mark.slow
@pytest.mark.parametrize("while_generating", [True, False])
def test_the_pause_is_awaited_at_the_commit_where_servers_stage_while_generating(server, model_dir,
                                                                                  while_generating):
    """tandem serve stages while it generates: an update that pauses (here: servers whose commit
    does not abort) sends the pause first and waits for it only before the commit, so the transfer
    runs under the pause's round trip. Here the pause's answer reaches the updater 0.3 s late: the
    buckets go out before it arrives, the commit after. Without the capability nothing is sent
    before the pause is answered."""
    server.ok("/_fault", {"clear": True})
    with HttpFleet([server.url], deadlines=FAST) as fleet:
        fleet.adapter = _Pausing() if while_generating else _PauseFirst()
        events: list[str] = []
        real = fleet.send

        def send(op, request, targets=None):
            events.append(op.name)
            future = real(op, request, targets)
            if op is not ops.PAUSE:
                return future
            late: Future = Future()

            def answer(done: Future) -> None:
                events.append("pause answered")
                late.set_result(done.result())

            future.add_done_callback(lambda done: threading.Timer(0.3, answer, (done,)).start())
            return late

        fleet.send = send
        meta = WeightUpdateMeta(type="distributed", bucket_bytes=BUCKET, deadlines=FAST)
        with WeightUpdater(CheckpointSource(model_dir, scale=1.5), fleet, meta) as updater:
            updater.update(501)
        assert version_of(server) == "501"
        answered, staged, committed = (events.index(e) for e in ("pause answered", "stage_distributed", "commit"))
        assert events[0] == "pause_generation" and answered < committed and staged < committed, events
        assert (staged < answered) == while_generating, events


class _Pausing(TandemAdapter):
    capabilities = dataclasses.replace(TandemAdapter.capabilities, commit_aborts=False)


class _PauseFirst(TandemAdapter):
    capabilities = dataclasses.replace(TandemAdapter.capabilities, stage_while_generating=False, commit_aborts=False)


@pytest.mark.slow
def test_set_version_after_a_commit_sends_nothing(server, model_dir):
    """The commit sets the version on every server with the weights, so the updater's `set_version`
    right after it needs no round trip; a version the fleet does not know every server echoes (any
    other call makes it forget) goes to the servers."""
    server.ok("/_fault", {"clear": True})
    with HttpFleet([server.url], deadlines=FAST) as fleet:
        sent = []
        real = fleet._post
        fleet._post = lambda op, *a: sent.append(op.name) or real(op, *a)
        _update(model_dir, fleet, 301)
        # (the group is left when the updater closes)
        assert "set_version" not in sent and sent.index("commit") < sent.index("continue_generation"), sent
        assert sent[-2:] == ["continue_generation", "leave_group"], sent
        assert version_of(server) == "301"
        sent.clear()
        call(fleet, ops.SET_VERSION, ops.SetVersion(301))  # after continue_generation: not known any more, sent
        assert not call(fleet, ops.SET_VERSION, ops.SetVersion(301)).failures  # now known: nothing sent
        assert sent == ["set_version"]
        server.ok("/update_weight_version", {"new_version": "999"})  # someone else moves it
        call(fleet, ops.CONTINUE, ops.ContinueGeneration())
        call(fleet, ops.SET_VERSION, ops.SetVersion(301))
        assert sent == ["set_version", "continue_generation", "set_version"]
        assert version_of(server) == "301"

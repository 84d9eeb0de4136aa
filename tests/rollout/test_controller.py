"""RolloutController against fake servers: the callback server's auth, fleet fan-out through
RolloutCallback (results per server, failures named), the controller's own Fleet methods, and
rollout worker processes (episodes reported over HTTP, a dying worker's episodes rejected)."""

from __future__ import annotations

import dataclasses
import inspect
import json
import os
import pickle
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tandem.rollout import (
    GenerationParams,
    ModelRequest,
    RewardRunner,
    RolloutCallback,
    RolloutConfig,
    RolloutController,
    RolloutWorkflow,
)
from tandem.rollout.callback import meta_from_json, meta_to_json, result_from_json, result_to_json
from tandem.rollout.fleet_wire import FLEET_OPS, decode_call, encode_call
from tandem.weights.fleet import Fleet, FleetError, FleetResult, ServerResult
from tandem.weights.http_fleet import HttpFleet
from tandem.weights.meta import Deadlines, FlatLayout, ParamSpec, ShmBucket, WeightUpdateMeta
from tests.launch.pool_owner import kill_owner_and_check, start_owner
from tests.launch.procs import Marked
from tests.rollout.conftest import REPO
from tests.rollout.fake_server import chain

pytestmark = pytest.mark.timeout(90)


class Echo(RolloutWorkflow):
    """One sample per item (token-id lists); picklable, so it runs in rollout workers too."""

    def __init__(self, max_new_tokens: int = 4):
        self.params = GenerationParams(max_new_tokens=max_new_tokens)

    async def arun_episode(self, client, item):
        if item == "bad":
            raise RuntimeError("this workflow blew up")
        if item == "reject":
            return None
        if item == "die":
            os.kill(os.getpid(), signal.SIGKILL)
        if isinstance(item, tuple) and item[0] == "block":  # blocks the event loop (as CPU work done in place would), once it says so
            Path(item[1]).touch()
            time.sleep(120)
        resp = await client.agenerate(ModelRequest(list(item), self.params))
        return resp.to_trajectory(prompt_id=str(item[0]), info={"pid": os.getpid()})


def dead_address() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


@pytest.fixture
def make_controller():
    made: list[RolloutController] = []

    def make(servers, **config) -> RolloutController:
        ctl = RolloutController(RolloutConfig(servers=list(servers), **config))
        made.append(ctl)
        return ctl

    yield make
    for ctl in made:
        ctl.shutdown()


def post(url: str, body, headers=None) -> tuple[int, dict]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def test_callback_server_rejects_a_missing_or_wrong_secret(make_server, make_controller):
    server = make_server()
    ctl = make_controller([server.address])
    url = ctl.callback_address() + "/fleet/pause_generation"
    assert ctl.callback_address().startswith("http://127.0.0.1:")
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": ctl.secret}):
        status, body = post(url, {}, headers)
        assert status == 401 and body["success"] is False, (headers, status, body)
    assert server._running.is_set()  # nothing reached the server: still running
    with pytest.raises(FleetError, match="rejected the callback secret") as err:
        RolloutCallback(ctl.callback_address(), "wrong").pause_generation()
    assert err.value.phase == "pause_generation"
    status, body = post(url, {}, {"Authorization": f"Bearer {ctl.secret}"})
    assert status == 200 and [r["success"] for r in body["results"]] == [True]
    assert "secret" not in repr(ctl.callback()) and ctl.secret not in repr(ctl.callback())


def test_reward_runner_pickles_as_its_settings():
    runner = pickle.loads(pickle.dumps(RewardRunner(max_workers=3, timeout_s=7, grace_s=2)))
    assert (runner.max_workers, runner.timeout_s, runner.grace_s) == (3, 7, 2) and runner._pool is None


def test_wire_forms_round_trip():
    meta = WeightUpdateMeta("disk", path="/tmp/w", version=3, deadlines=Deadlines(update_s=5))
    assert meta_from_json(json.loads(json.dumps(meta_to_json(meta)))) == meta
    res = FleetResult("p", (ServerResult("a", True, "ok"), ServerResult("b", False, "no")))
    assert result_from_json(json.loads(json.dumps(result_to_json(res)))) == res


def test_every_fleet_argument_travels_through_the_controller():
    """The callback, the controller and HttpFleet take the same arguments for every Fleet
    operation, and the wire form carries each of them (flat layouts, shm buckets, staging)."""
    for op, (positional, keywords) in FLEET_OPS.items():
        want = [(p.name, p.kind, p.default) for p in inspect.signature(getattr(HttpFleet, op)).parameters.values()]
        assert [n for n, *_ in want[1:]] == [*positional, *keywords], op
        assert {n: d for n, k, d in want if k is inspect.Parameter.KEYWORD_ONLY} == keywords, op
        for cls in (RolloutCallback, RolloutController, Fleet):
            got = [(p.name, p.kind, p.default) for p in inspect.signature(getattr(cls, op)).parameters.values()]
            assert got == want, (cls.__name__, op)
    assert {m for m in dir(Fleet) if not m.startswith("_")} - {"world_size"} == set(FLEET_OPS)
    assert RolloutCallback.supports_flat_buckets and RolloutController.supports_flat_buckets
    meta = WeightUpdateMeta("distributed", version=7, deadlines=Deadlines(bucket_s=3))
    specs = [ParamSpec("a", (2, 3), "bfloat16"), ParamSpec("b", (4,), "float32")]
    shm = ShmBucket(tuple(specs), (0, 64), 80, segment="tandem-w-1-0")
    calls = {
        "update_weights_from_distributed": dict(meta=meta, specs=specs, commit=False, bucket_index=2,
                                                flat=FlatLayout((0, 64), 80)),
        "update_weights_from_shm": dict(meta=meta, bucket=shm, commit=False, bucket_index=0),
        "update_weights_from_disk": dict(meta=dataclasses.replace(meta, type="disk", path="/w"), commit=False),
        "weight_checksums": dict(names=["a"]),
        "set_version": dict(version=7),
    }
    for op, arguments in calls.items():
        args, kwargs = decode_call(op, json.loads(json.dumps(encode_call(op, **arguments))))
        positional, _ = FLEET_OPS[op]
        assert {**dict(zip(positional, args, strict=True)), **kwargs} == arguments, op
    # Keywords left out (an older caller) take the Fleet defaults: one full-set update, per tensor.
    args, kwargs = decode_call("update_weights_from_distributed", {"meta": meta_to_json(meta), "specs": []})
    assert kwargs == {"commit": True, "bucket_index": None, "flat": None}
    with pytest.raises(TypeError):
        encode_call("update_weights_from_shm", meta=meta, bucket=shm)


def test_callback_fans_out_and_names_failing_servers(make_server, make_controller):
    servers = [make_server(), make_server()]
    ctl = make_controller([s.address for s in servers])
    cb = pickle.loads(pickle.dumps(ctl.callback()))  # what a trainer worker receives
    assert RolloutCallback.from_env(ctl.callback().env()).secret == ctl.secret
    assert cb.world_size == 2
    res = cb.pause_generation()
    assert res.phase == "pause_generation" and [r.address for r in res.results] == [s.address for s in servers]
    assert all(not s._running.is_set() for s in servers)
    assert ctl.executor.stats()["paused"]  # dispatch stops with the servers
    cb.set_version(4)
    assert [s.version for s in servers] == [4, 4] and ctl.version == 4
    cb.continue_generation()
    assert all(s._running.is_set() for s in servers) and not ctl.executor.stats()["paused"]
    # The fake servers have no weight routes: the failure names every server and the phase.
    fut = cb.update_weights_from_disk(WeightUpdateMeta("disk", path="/nowhere", version=5))
    with pytest.raises(FleetError) as err:
        fut.result(30)
    assert err.value.phase == "update_weights_from_disk"
    assert {f.address for f in err.value.failures} == {s.address for s in servers}
    assert "HTTP 404" in str(err.value)
    # A driver pause survives a fleet continue.
    ctl.pause()
    cb.pause_generation()
    cb.continue_generation()
    assert ctl.executor.stats()["paused"]
    ctl.resume()
    assert not ctl.executor.stats()["paused"]
    cb.close()


def test_a_dead_server_is_reported_not_skipped(make_server, make_controller):
    server = make_server()
    gone = dead_address()
    ctl = make_controller([server.address, gone])
    with pytest.raises(FleetError) as err:
        ctl.callback().pause_generation()
    assert err.value.phase == "pause_generation"
    assert [f.address for f in err.value.failures] == [gone]
    assert "ClientConnectorError" in err.value.failures[0].message
    assert not ctl.pool.is_healthy(gone) and ctl.pool.is_healthy(server.address)
    with pytest.raises(FleetError):  # the controller's own Fleet methods behave the same
        ctl.continue_generation()
    assert server._running.is_set()  # the live server did continue
    # A controller that is gone: the error names the controller.
    with pytest.raises(FleetError, match="controller unreachable"):
        RolloutCallback(dead_address(), "s").set_version(1)


def test_rollout_workers_run_episodes_and_report_them(make_server, make_controller, caplog):
    servers = [make_server(), make_server()]
    ctl = make_controller([s.address for s in servers], workers=2, consumer_batch_size=32, max_concurrent_rollouts=8)
    assert len(set(ctl.workers.pids)) == 2
    wf = Echo()
    items = [[i + 1, i + 2] for i in range(12)]
    trajs = ctl.rollout_batch([*items[:6], "bad", "reject", *items[6:]], wf, timeout=30)
    assert [t.input_ids[:2] for t in trajs] == items  # item order; the bad and rejected ones are gone
    for t in trajs:
        assert t.input_ids[2:] == chain(t.input_ids[1], 4, 1000)
        assert t.info["pid"] in ctl.workers.pids
    assert {t.info["pid"] for t in trajs} == set(ctl.workers.pids)  # both workers took episodes
    stats = ctl.stats()
    assert stats["failed"] == 1 and stats["rejected"] == 2 and stats["accepted"] == 12
    assert "this workflow blew up" in caplog.text  # the worker's traceback reaches the controller log
    # Shared queue + versions reach the workers' clients.
    ctl.set_version(1)
    for it in items[:4]:
        ctl.submit(it, wf)
    got = ctl.wait(4, timeout=30)
    assert len(got) == 4 and all(t.min_version == 1 for t in got)
    # A worker that dies fails its episode at once (rejected); the other worker goes on.
    before = time.monotonic()
    assert ctl.rollout_batch(["die"], wf, timeout=30) == []
    assert time.monotonic() - before < 10
    assert len(ctl.rollout_batch(items[:4], wf, timeout=30)) == 4
    assert "exited" in caplog.text


@pytest.mark.parametrize("workers", [0, 2])
def test_a_waiting_controller_uses_no_cpu(spawn_server, workers):
    """A controller process (and its rollout workers) waiting 3 s on a slow server: < 0.1 s CPU each."""
    address, _ = spawn_server("--token-delay", "0.5")  # 64 tokens: 32 s, far past the window
    out = subprocess.run(
        [sys.executable, "-m", "tests.rollout.controller_proc", "--servers", address, "--workers", str(workers),
         "--wait", "3"],
        cwd=REPO, capture_output=True, text=True, timeout=60,
    )
    assert out.returncode == 0, out.stderr
    m = json.loads(out.stdout.strip().splitlines()[-1])
    print(f"\nworkers={workers}: {m['wall_s']:.2f} s wall, controller {m['controller_cpu_s'] * 1000:.1f} ms CPU, "
          f"workers {m['workers_cpu_s'] * 1000:.1f} ms CPU")
    assert m["running"] == 1 and not m["finished"] and m["workers"] == workers
    assert m["wall_s"] >= 3.0
    assert m["controller_cpu_s"] < 0.1
    assert m["workers_cpu_s"] < 0.1


def test_rollout_workers_die_with_the_controller(spawn_server, tmp_path):
    """SIGKILL of the controller while a rollout worker's event loop is blocked: the worker cannot
    act on its command pipe closing; the parent-death signal ends it at once."""
    address, _ = spawn_server()
    marked = Marked()
    try:
        proc, workers = start_owner(marked, "tests.rollout.worker_owner", address, str(tmp_path / "blocking"))
        assert (tmp_path / "blocking").exists()
        kill_owner_and_check(marked, proc, workers, "controller with a blocked rollout worker", pool=False)
    finally:
        marked.clean_up()

"""RolloutController against fake servers: the callback server's auth, fleet fan-out through
RolloutCallback (results per server, failures named), the controller's own Fleet methods, and
rollout worker processes (episodes reported over HTTP, a dying worker's episodes rejected)."""

from __future__ import annotations

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

from tandem.fleet import ops
from tandem.fleet.interface import call
from tandem.fleet.results import FleetError
from tandem.rollout import (
    GenerationParams,
    ModelRequest,
    RewardRunner,
    RolloutCallback,
    RolloutConfig,
    RolloutController,
    RolloutWorkflow,
)
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
    join = {"Authorization": f"Bearer {ctl.join_token}"}  # joins and `tandem fleet` only
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": ctl.secret}, join):
        status, body = post(url, {"request": {}}, headers)
        assert status == 401 and body["success"] is False, (headers, status, body)
    assert server._running.is_set()  # nothing reached the server: still running
    with pytest.raises(FleetError, match="rejected the callback secret") as err:
        call(RolloutCallback(ctl.callback_address(), "wrong"), ops.PAUSE, ops.PauseGeneration())
    assert err.value.phase == "pause_generation"
    status, body = post(url, {"request": {}}, {"Authorization": f"Bearer {ctl.secret}"})
    assert status == 200 and [r["success"] for r in body["results"]] == [True]
    status, body = post(url, {}, {"Authorization": f"Bearer {ctl.secret}"})
    assert status == 400 and "body.request" in body["message"], body
    req = urllib.request.Request(ctl.callback_address() + "/fleet/members", headers=join)
    with urllib.request.urlopen(req, timeout=10) as resp:
        assert [s["state"] for s in json.loads(resp.read())["servers"]] == ["healthy"]
    assert "secret" not in repr(ctl.callback()) and ctl.secret not in repr(ctl.callback())


def test_reward_runner_pickles_as_its_settings():
    runner = pickle.loads(pickle.dumps(RewardRunner(max_workers=3, timeout_s=7, grace_s=2)))
    assert (runner.max_workers, runner.timeout_s, runner.grace_s) == (3, 7, 2) and runner._pool is None


def test_callback_fans_out_and_names_failing_servers(make_server, make_controller):
    servers = [make_server(), make_server()]
    ctl = make_controller([s.address for s in servers])
    cb = pickle.loads(pickle.dumps(ctl.callback()))  # what a trainer worker receives
    assert RolloutCallback.from_env(ctl.callback().env()).secret == ctl.secret
    assert cb.world_size == 2
    res = call(cb, ops.PAUSE, ops.PauseGeneration())
    assert res.phase == "pause_generation" and [r.address for r in res.results] == [s.address for s in servers]
    assert all(not s._running.is_set() for s in servers)
    assert ctl.executor.stats()["paused"]  # dispatch stops with the servers
    call(cb, ops.SET_VERSION, ops.SetVersion(4))
    assert [s.version for s in servers] == [4, 4] and ctl.version.value == 4
    call(cb, ops.COMMIT, ops.CommitStaged(5))  # a commit that does not announce: the controller waits
    assert [s.version for s in servers] == [5, 5] and ctl.version.value == 4
    call(cb, ops.COMMIT, ops.CommitStaged(6, announce=True))  # nothing checked after it: it announces
    assert [s.version for s in servers] == [6, 6] and ctl.version.value == 6
    assert ctl.fleet.membership.current_version == 6
    call(cb, ops.CONTINUE, ops.ContinueGeneration())
    assert all(s._running.is_set() for s in servers) and not ctl.executor.stats()["paused"]
    # A driver pause survives a fleet continue.
    ctl.pause()
    call(cb, ops.PAUSE, ops.PauseGeneration())
    call(cb, ops.CONTINUE, ops.ContinueGeneration())
    assert ctl.executor.stats()["paused"]
    ctl.resume()
    assert not ctl.executor.stats()["paused"]
    # The fake servers have no weight routes: the failure names every server and the phase, and a
    # server that failed an operation leaves the fleet (it may hold anything now).
    fut = cb.send(ops.LOAD_DISK, ops.DiskLoad("/nowhere", commit=False))
    with pytest.raises(FleetError) as err:
        fut.result(30)
    assert err.value.phase == "load_disk"
    assert {f.address for f in err.value.failures} == {s.address for s in servers}
    assert "HTTP 404" in str(err.value)
    assert [r["state"] for r in ctl.members()["servers"]] == ["evicted", "evicted"]
    assert cb.world_size == 0 and ctl.pool.addresses == []
    cb.close()


def test_a_dead_server_is_reported_not_skipped(make_server, make_controller):
    server = make_server()
    gone = dead_address()
    ctl = make_controller([server.address, gone])
    with pytest.raises(FleetError) as err:
        call(ctl.callback(), ops.PAUSE, ops.PauseGeneration())
    assert err.value.phase == "pause_generation"
    assert [f.address for f in err.value.failures] == [gone]
    assert "cannot connect" in err.value.failures[0].message and "refused" in err.value.failures[0].message
    assert not ctl.pool.is_healthy(gone) and ctl.pool.is_healthy(server.address)
    # It failed a control call: evicted, so the fleet's operations go to the live server only.
    assert ctl.fleet.membership.record(gone).state.value == "evicted"
    result = call(ctl, ops.CONTINUE, ops.ContinueGeneration())
    assert [r.address for r in result.results] == [server.address]
    assert server._running.is_set()  # the live server did continue
    with pytest.raises(FleetError):  # named explicitly, the dead one still fails
        call(ctl, ops.CONTINUE, ops.ContinueGeneration(), [server.address, gone])
    # A controller that is gone: the error names the controller.
    with pytest.raises(FleetError, match="controller unreachable"):
        call(RolloutCallback(dead_address(), "s"), ops.SET_VERSION, ops.SetVersion(1))


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
    call(ctl, ops.SET_VERSION, ops.SetVersion(1))
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


def test_a_joiner_says_how_many_devices_it_spans(make_server, make_controller):
    """`POST /fleet/join` with `devices`: the controller's topology gives that server as many
    transfer-group ranks once it warms; listed servers span what `rollout.backend` gives each;
    a count below 1 is refused (400) naming the field."""
    from tandem.fleet.run_file import ControllerClient, ControllerFile, ControllerFileError

    listed, joiner = make_server(), make_server()
    ctl = make_controller([listed.address], backend="sglang:d1t2", topology_cooldown_s=0.0)
    client = ControllerClient(ControllerFile(ctl.callback_address(), ctl.join_token, None, os.getpid()))
    assert client.join(joiner.address, None, devices=4) == "joining"
    deadline = time.monotonic() + 30
    while joiner.address not in ctl.topology().warming and time.monotonic() < deadline:
        time.sleep(0.1)  # the health monitor's probe moves it to warming
    topology = ctl.topology()
    assert topology.members == (listed.address,) and topology.warming == (joiner.address,)
    assert topology.ranks([*topology.members, *topology.warming]).offsets == (1, 3)
    assert ctl.fleet.world_size == 2  # the members' devices; the joiner counts once admitted
    with pytest.raises(ControllerFileError, match=r"body\.devices must be at least 1"):
        client.join(dead_address(), None, devices=0)

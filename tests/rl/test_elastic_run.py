"""An elastic fleet in a real `tandem train` run (three launched servers, two trainer ranks):

- kill -9 one server in the middle of the run: it is evicted at once (the launcher saw it exit),
  its in-flight episodes complete elsewhere, `rollout/lost_total` stays 0 in every row, and with
  `rollout.replace_dead=true` a replacement is launched and joins through warm-up;
- `tandem serve --join RUN_DIR` in the middle of the run: the server registers, is warmed from
  disk (checksums verified), enters the update group at the next rebuild, gets traffic, and holds
  the trainer's weights at the end (`train.verify_weights=true` compares every server's checksums
  with the trainer's after every update);
- `tandem fleet RUN_DIR --json` while the run goes on lists every server with the documented keys.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

from tandem.fleet.run_file import ControllerClient, ControllerFile, ControllerFileError, read_controller_file
from tests.inference.server_utils import ServerProcess
from tests.launch.procs import cmdline, descendants
from tests.rl.common import TANDEM, rl_rows, run_dir, write_config

pytestmark = pytest.mark.slow
KEYS = {"address", "pid", "state", "version", "in_flight", "tokens_served", "last_error"}
# Steps here take ~0.12 s and a server's start-up ~8 s (~65 steps; more under a loaded suite, where
# 120 steps once ended 1 s after the joiner was admitted, and 250 once ended before the second of
# the replacement and the joiner was: CI with the chaos soak beside it): 400 leave both ~25 s idle.
STEPS = 400


def _server(pids: set[int], index: int) -> int:
    for pid in pids:
        try:
            log = os.readlink(f"/proc/{pid}/fd/1")
        except OSError:
            continue
        if "-m tandem.cli serve" in cmdline(pid) and log.endswith(f"rollout-{index}.log"):
            return pid
    raise AssertionError(f"no server {index} among {sorted(pids)}")


def _fleet(run: Path, while_running: bool = False) -> list[dict]:
    """`tandem fleet RUN --json`; with `while_running`, [] when the run ended meanwhile (its
    controller.json is gone: the run may end between a check for the file and the command)."""
    out = subprocess.run([TANDEM, "fleet", str(run), "--json"], capture_output=True, text=True, timeout=30)
    if while_running and out.returncode != 0 and not (run / "controller.json").exists():
        return []
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def _wait_for_steps(tmp_path: Path, proc: subprocess.Popen, steps: int, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while len(rl_rows(tmp_path)) < steps:
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.monotonic() < deadline, "the run made no progress"
        time.sleep(0.5)


def test_kill_join_and_replace_in_a_running_job(tmp_path, model_dir):
    cfg = write_config(
        tmp_path, model_dir,
        rollout={"backend": "tandem:d3", "replace_dead": True, "topology_cooldown_s": 2.0,
                 "health": {"interval_s": 1.0, "timeout_s": 1.0}},
        train={"total_steps": STEPS, "verify_weights": True, "weight_sync": "distributed"},
        gen={"max_new_tokens": 32})
    proc = subprocess.Popen([TANDEM, "train", str(cfg)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    run = run_dir(tmp_path)
    joiner = api_key = None
    try:
        _wait_for_steps(tmp_path, proc, 2)
        listed = _fleet(run)
        assert len(listed) == 3 and all(set(s) == KEYS for s in listed), listed
        assert all(s["state"] == "healthy" and isinstance(s["pid"], int) for s in listed), listed
        api_key = json.loads((run / "controller.json").read_text())["api_key"]  # what the joiner requires
        client = ControllerClient(read_controller_file(run))
        # Started before the kill so its start-up overlaps the replacement's; a hang guard as long as
        # the run's own (60 s was overrun with a second `make test` beside this one).
        joiner = ServerProcess(model_dir, tmp_path, "--join", str(run), "--kv-cache-tokens", "4096", timeout=300,
                               wait=False)
        os.kill(_server(descendants(proc.pid), 1), signal.SIGKILL)
        _wait_for_steps(tmp_path, proc, 4)
        joiner.wait_ready(timeout=300)
        seen: dict[str, set[str]] = {}
        served = 0
        while proc.poll() is None:  # bounded by the run's own end (and the timeout below)
            try:  # in-process and often: the joiner's healthy spell is seen even if it starts late
                servers = client.members()["servers"]
            except ControllerFileError:  # the run is ending (its controller stops before the process exits);
                break                       # the checks below show it ended well and ran every step
            for s in servers:
                seen.setdefault(s["address"], set()).add(s["state"])
                if s["address"] == joiner.url:
                    served = max(served, s["tokens_served"])
            time.sleep(0.2)
        _, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        if joiner is not None and proc.returncode != 0:
            joiner.stop()
    assert proc.returncode == 0, err[-4000:]
    rows = rl_rows(tmp_path)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert all(r["rollout/lost_total"] == 0 for r in rows)
    last = rows[-1]
    assert last["fleet/evicted_total"] == 1 and last["fleet/joined_total"] == 2, last  # the replacement + joiner
    assert last["fleet/healthy"] == 4
    assert "rollout-1 (" in err and "exited (killed by SIGKILL); it leaves the fleet" in err
    # The joiner went through the join path (warming may last less than the 0.2 s the states are
    # polled at, so the controller's log says it) and served requests.
    assert "healthy" in seen[joiner.url], seen[joiner.url]
    assert f"{joiner.url} answers; warming up" in err and f"{joiner.url} joined the fleet at version" in err
    assert served > 0
    # After the run: the joiner holds the last version, and its weights passed every verification.
    request = urllib.request.Request(joiner.url + "/get_weight_version", headers={"Authorization": f"Bearer {api_key}"})
    with urllib.request.urlopen(request, timeout=10) as resp:
        assert json.loads(resp.read())["weight_version"] == str(STEPS)
    joiner.stop()
    assert not (run / "controller.json").exists()


PHASES = {  # fault injection on the victim's routes (the run's servers start with TANDEM_FAULT_INJECTION=1)
    "announce": ("distributed", {"route": "update_weights_from_distributed", "action": "kill", "nth": 2}),
    "broadcast": ("distributed", {"route": "update_weights_from_distributed", "action": "kill", "nth": 2,
                                  "after_tensors": 1}),
    "staged-before-commit": ("distributed", {"route": "commit_staged_weights", "action": "kill", "nth": 2}),
    # Also the run that shows launched servers take disk updates at all (they load only below the
    # directories they were started with; the launcher gives them the run's weight directory):
    # both hold the first update (sync/servers == 2), the survivor every later one.
    "disk": ("disk", {"route": "update_weights_from_disk", "action": "kill", "nth": 2}),
}


def _wait_for_controller(run: Path, proc: subprocess.Popen, timeout: float = 300) -> ControllerFile:
    """The run's controller.json, once written (after its servers and ranks started: 120 s was
    overrun with two other test runs on the machine). A guard against a hang, not a speed claim."""
    deadline = time.monotonic() + timeout
    while not (run / "controller.json").exists():
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.monotonic() < deadline, "controller.json never appeared"
        time.sleep(0.05)
    return read_controller_file(run)


@pytest.mark.parametrize("phase", list(PHASES))
def test_a_server_killed_in_an_update_phase_leaves_the_run_going(tmp_path, model_dir, phase):
    """A launched server SIGKILLs itself in one phase of its second weight update (fault
    injection, set as soon as the controller is up, before the first update): that update
    completes on the other server, the next ones go to it alone, and the run finishes every step
    with nothing lost."""
    sync, fault = PHASES[phase]
    steps = 8
    cfg = write_config(tmp_path, model_dir, train={"total_steps": steps, "weight_sync": sync, "verify_weights": True})
    env = {**os.environ, "TANDEM_FAULT_INJECTION": "1"}
    proc = subprocess.Popen([TANDEM, "train", str(cfg)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, env=env)
    run = run_dir(tmp_path)
    try:
        info = _wait_for_controller(run, proc)
        victim = ControllerClient(info).members()["servers"][1]["address"]
        request = urllib.request.Request(victim + "/_fault", data=json.dumps(fault).encode(), method="POST",
                                         headers={"Authorization": f"Bearer {info.api_key}",
                                                  "Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=10) as resp:
            assert resp.status == 200
        _, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, err[-4000:]
    rows = rl_rows(tmp_path)
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    assert all(r["rollout/lost_total"] == 0 for r in rows)
    servers = [int(r["sync/servers"]) for r in rows]
    assert servers[0] == 2 and servers[-1] == 1 and servers == sorted(servers, reverse=True), servers
    assert rows[-1]["fleet/evicted_total"] == 1 and rows[-1]["fleet/healthy"] == 1
    assert rows[-1]["fleet/generation"] == rows[0]["fleet/generation"] + 1  # one membership change: the eviction
    if phase in ("announce", "broadcast"):
        assert max(r["sync/attempts"] for r in rows) == 2  # the broadcast went again without the dead server
    if sync == "disk":
        assert (run / "weights").is_dir()

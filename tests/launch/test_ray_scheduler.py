"""`scheduler.type=ray` (issue 24) against a real Ray cluster. Ray binds every interface and looks for
the machine's address, so every test runs its controller (the Ray driver, which starts a private
Ray, or joins one the test starts there) inside a network namespace of its own that has only
loopback (`unshare --net`): nothing it sends can leave it."""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import subprocess
import tempfile
import time

import pytest

from tests.launch.procs import CHILD_ENV, REPO
from tests.rl.common import TANDEM, rl_rows, run_dir, write_config

pytestmark = pytest.mark.slow
PY = os.path.join(os.path.dirname(TANDEM), "python")
PLACED_WITHIN_S = 90.0  # the demo's 4 processes placed: Ray up, 2 servers healthy, the ranks placed (here 24 s)


@pytest.fixture(scope="module", autouse=True)
def _ray_and_namespaces():
    why = None
    try:
        import ray  # noqa: F401
    except ImportError:
        why = "Ray is not installed (pip install 'ray>=2.40'; `make test` installs it)"
    if why is None and (os.geteuid() != 0 or shutil.which("unshare") is None or shutil.which("ip") is None):
        why = "a loopback-only network namespace for Ray needs root, util-linux's `unshare` and iproute2's `ip`"
    if why:
        print(f"Ray tests skipped: {why}")
        pytest.skip(why)


def _in_private_network(*cmd: str, timeout_s: float, env: dict[str, str] | None = None,
                        own_pids: bool = False) -> subprocess.CompletedProcess:
    """Run `cmd` in a new network namespace with only `lo` up; `own_pids`: in a PID namespace of its
    own too, so that a `ray stop` in it sees (and kills) only its own Ray processes, not those of
    another test run's Ray cluster on the machine (`ray stop` matches processes by name, machine-wide)."""
    return subprocess.run(_private_network_argv(cmd, own_pids), cwd=REPO, capture_output=True, text=True,
                          timeout=timeout_s, start_new_session=True, env=_private_network_env(env))


def _private_network_argv(cmd: tuple[str, ...], own_pids: bool) -> list[str]:
    script = 'ip link set lo up && exec "$@"'
    # --kill-child: killing `unshare` (a timeout) ends everything in the PID namespace too
    isolate = ["--net", "--pid", "--fork", "--kill-child", "--mount-proc"] if own_pids else ["--net"]
    return ["unshare", *isolate, "sh", "-c", script, "sh", *cmd]


def _private_network_env(env: dict[str, str] | None) -> dict[str, str]:
    return {**os.environ, **CHILD_ENV, "RAY_USAGE_STATS_ENABLED": "0", **(env or {})}


def test_ranks_as_ray_actors_and_an_actor_death(tmp_path):
    out = _in_private_network(PY, "-m", "tests.launch.ray_driver", str(tmp_path / "run"), timeout_s=300)
    assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    print(f"Ray: 2-rank group all_reduce {result['sums']}; actor of rank 1 killed -> WorkerCrashedError after "
          f"{result['crash_after_s']:.2f}s")
    assert result["sums"] == [3.0, 3.0]  # one gloo group across the two actors' processes
    # the scheduler.ray keys the driver loaded: num_cpus, namespace, strategy, cpus_per_process
    assert result["ray"] == {"cpus": 3.0, "namespace": "tdm-driver", "strategy": "SPREAD",
                             "bundles": [{"CPU": 0.5}, {"CPU": 0.5}]}, result["ray"]
    assert [role for role, _ in result["placement"]] == ["actor-rank0", "actor-rank1"]
    assert all(re.match(r"Ray node 127\.0\.0\.1 \(\S+\), pid \d+", where) for _, where in result["placement"])
    # the death surfaces like a local one: role, rank, why, its log
    crash = result["crash"]
    assert "rank 1" in crash and "during 'sleep'" in crash and "Ray actor died" in crash, crash
    assert "actor-rank1: pid" in crash and "serving RPC" in crash, crash  # the tail of its log
    assert result["crash_after_s"] < 10
    assert result["left"] == [], "processes of the actors outlived the scheduler"
    # a placement the cluster's total resources can never hold is refused at once, naming the numbers
    refused = result["impossible"]
    assert result["impossible_after_s"] < 10, result["impossible_after_s"]
    assert "can never place 8 bundle(s) of {'CPU': 0.5}" in refused and "'CPU': 4.0" in refused, refused
    assert "'CPU': 3.0" in refused and "scheduler.ray.cpus_per_process" in refused, refused


def test_the_demo_shape_starts_on_a_private_ray_on_this_machine(tmp_path, tiny_model):
    """The demo's shape (2 servers, 2 trainer ranks: 4 one-CPU bundles) with `scheduler.type=ray`
    and no address: the private Ray is sized to the run, so all four are placed on this 2-CPU
    machine within PLACED_WITHIN_S and the run finishes. Before, the cluster had the machine's 2
    CPUs: the servers took them and the ranks' group waited for the 300 s placement timeout ("Ray
    could not place 2 bundle(s) of {'CPU': 1.0} (PACK) within 300s")."""
    cfg = write_config(tmp_path, tiny_model, scheduler={"type": "ray"}, train={"total_steps": 1},
                       task={"eval_size": 2})
    log_path = run_dir(tmp_path) / "logs" / "controller.log"

    def log() -> str:
        return log_path.read_text() if log_path.is_file() else ""

    began = time.monotonic()
    with tempfile.TemporaryFile("w+") as output:
        run = subprocess.Popen(_private_network_argv((TANDEM, "train", str(cfg)), own_pids=True), cwd=REPO,
                               stdout=output, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                               env=_private_network_env(None))
        try:
            while "placement: actor-rank1 ->" not in log() and run.poll() is None:
                if time.monotonic() - began > PLACED_WITHIN_S:
                    pytest.fail(f"the demo's 4 processes were not placed within {PLACED_WITHIN_S:.0f} s:\n"
                                f"{log()[-3000:]}")
                time.sleep(0.5)
            placed = time.monotonic() - began
            returncode = run.wait(timeout=180)
        finally:
            run.kill()  # `unshare --kill-child`: everything in the namespace goes with it
            run.wait()
        output.seek(0)
        printed = output.read()
    took = time.monotonic() - began
    assert returncode == 0, printed[-4000:] + log()[-3000:]
    assert [r["step"] for r in rl_rows(tmp_path)] == [1]
    machine = os.cpu_count() or 1
    cpus = max(machine, 4)
    text = log()
    assert re.search(rf"ray: started a private cluster in [\d.]+ s \(.*'CPU': {cpus}\.0", text), text[-3000:]
    if machine < 4:
        assert f"gets {cpus} logical CPU(s), more than this machine's {machine}" in text, text[-3000:]
        assert "2 server(s) + 2 trainer rank(s) x scheduler.ray.cpus_per_process=1 reserve 4 CPU(s)" in text
    for role in ("rollout-0", "rollout-1", "actor-rank0", "actor-rank1"):
        assert re.search(rf"placement: {role} -> Ray node 127\.0\.0\.1 \(\S+\), pid \d+", text), text[-3000:]
    print(f"Ray: demo shape (2 servers, 2 ranks) on a private cluster of {cpus} CPUs on {machine}: all placed "
          f"after {placed:.1f} s, 1 step done in {took:.1f} s")


def test_a_teacher_fleet_is_placed_on_the_private_ray(tmp_path, tiny_model):
    """Distillation with a launched teacher (`teacher.backend=tandem:d1`) on `scheduler.type=ray`:
    the private cluster is sized for the teacher's server too (3 one-CPU bundles), the teacher is
    placed like the rollout servers, and every step's episodes are scored by it."""
    cfg = write_config(tmp_path, tiny_model, scheduler={"type": "ray"}, train={"total_steps": 2},
                       actor={"backend": "archon:d1"}, rollout={"backend": "tandem:d1"}, algo={"name": "distill"},
                       teacher={"path": str(tiny_model), "backend": "tandem:d1",
                                "server_args": ["--num-threads", "1"]}, task={"eval_size": 2})
    out = _in_private_network(TANDEM, "train", str(cfg), timeout_s=480, own_pids=True)
    log = (run_dir(tmp_path) / "logs" / "controller.log").read_text()
    assert out.returncode == 0, (out.stdout + out.stderr)[-4000:] + log[-3000:]
    rows = rl_rows(tmp_path)
    assert [r["step"] for r in rows] == [1, 2] and rows[-1]["teacher/scored_total"] >= 2 * 4 * 2
    assert re.search(r"ray: started a private cluster in [\d.]+ s \(.*'CPU': 3\.0", log), log[-3000:]
    for role in ("rollout-0", "teacher-0", "actor-rank0"):
        assert re.search(rf"placement: {role} -> Ray node 127\.0\.0\.1 \(\S+\), pid \d+", log), log[-3000:]


def test_train_on_a_running_ray_cluster(tmp_path, tiny_model):
    """`ray start --head` in the namespace, then `tandem train` joins it (scheduler.ray.address)."""
    port = str(6379 + os.getpid() % 1000)
    cfg = write_config(tmp_path, tiny_model, scheduler={"type": "ray", "ray": {"address": f"127.0.0.1:{port}"}},
                       train={"total_steps": 3}, actor={"backend": "archon:d1"}, rollout={"backend": "tandem:d1"})
    ray_bin = os.path.join(os.path.dirname(TANDEM), "ray")
    temp_dir = tempfile.mkdtemp(prefix="tdm-ray-")  # short: Ray's socket paths must fit in 107 bytes
    head = (f"{ray_bin} start --head --port {port} --num-cpus 2 --node-ip-address 127.0.0.1 --include-dashboard false "
            f"--disable-usage-stats --temp-dir {temp_dir}")
    script = f'{head} >{tmp_path / "ray-start.log"} 2>&1 && "$@"; rc=$?; {ray_bin} stop --force >/dev/null 2>&1; exit $rc'
    try:
        # the cluster requires a token (Ray's token authentication), which the controller is given too
        token = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)}
        out = _in_private_network("sh", "-c", script, "sh", TANDEM, "train", str(cfg), timeout_s=480, env=token,
                                  own_pids=True)
    finally:
        shutil.rmtree(temp_dir, ignore_errors=True)
    assert out.returncode == 0, (out.stdout + out.stderr)[-4000:] + (tmp_path / "ray-start.log").read_text()[-2000:]
    assert [r["step"] for r in rl_rows(tmp_path)] == [1, 2, 3]
    log = (run_dir(tmp_path) / "logs" / "controller.log").read_text()
    assert f"ray: joined 127.0.0.1:{port}" in log, log[-3000:]
    assert re.search(r"ray: joined .*'CPU': 2\.0", log), log[-3000:]  # a cluster Tandem joins is not resized
    for role in ("rollout-0", "actor-rank0"):
        assert re.search(rf"placement: {role} -> Ray node 127\.0\.0\.1 \(\S+\), pid \d+", log), log[-3000:]


def test_ray_stop_in_the_test_namespace_spares_other_runs_ray(tmp_path):
    """Catches the head test's `ray stop --force` killing another test run's Ray on the machine: it
    matches processes by name, machine-wide, and took a second `make test`'s cluster down with it
    ("Failed to connect to GCS within 60 seconds"). Run in the test's own PID namespace, it must
    leave a process named like Ray's GCS outside alone."""
    fake = tmp_path / "gcs_server"  # `ray stop` picks its victims by this name
    shutil.copy(shutil.which("sleep"), fake)
    other = subprocess.Popen([str(fake), "120"])
    try:
        ray_bin = os.path.join(os.path.dirname(TANDEM), "ray")
        out = _in_private_network(ray_bin, "stop", "--force", timeout_s=120, own_pids=True)
        assert out.returncode == 0, out.stdout + out.stderr
        assert other.poll() is None, f"`ray stop` in the namespace killed a process outside it:\n{out.stderr[-2000:]}"
    finally:
        other.kill()
        other.wait()

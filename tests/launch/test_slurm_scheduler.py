"""`tandem train` with `scheduler.type=slurm` on a real single-node Slurm (issue 24): every role is
an `srun` job of the test's `slurmctld`/`slurmd`; a server's job cancelled mid-run is evicted
like a dead server and the run completes; the trainer's job cancelled mid-run ends the run, which
names it. All on 127.0.0.1."""

from __future__ import annotations

import os
import re
import subprocess
import time

import pytest

from tests.launch.procs import CHILD_ENV
from tests.rl.common import TANDEM, rl_rows, run_dir, write_config

pytestmark = pytest.mark.slow

STEPS = 200  # of the run whose server job is cancelled


def _jobs(cluster) -> dict[str, str]:
    """Running jobs of the cluster: name -> id."""
    out = subprocess.run(["squeue", "--noheader", "--format", "%j %i %T"], env=cluster.env, capture_output=True,
                         text=True, timeout=30, check=True).stdout
    return {name: job for name, job, state in (line.split() for line in out.splitlines()) if state == "RUNNING"}


def _start(cluster, tmp_path, model, steps: int, slurm: dict | None = None, **sections: dict) -> subprocess.Popen:
    cfg = write_config(tmp_path, model, scheduler={"type": "slurm", "slurm": slurm or {}},
                       train={"total_steps": steps}, actor={"backend": "archon:d1"}, **sections)
    return subprocess.Popen([TANDEM, "train", str(cfg)], env={**os.environ, **CHILD_ENV, **cluster.env},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)


def _wait_for_step(proc: subprocess.Popen, tmp_path, step: int, timeout_s: float = 240) -> None:
    deadline = time.monotonic() + timeout_s
    while not any(r["step"] >= step for r in rl_rows(tmp_path)):
        assert proc.poll() is None, f"the run ended early:\n{proc.stdout.read()[-4000:]}"
        assert time.monotonic() < deadline, f"no step {step} within {timeout_s:.0f}s"
        time.sleep(0.2)


def _finish(proc: subprocess.Popen, timeout_s: float = 300) -> str:
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        out, _ = proc.communicate()
        raise AssertionError(f"the run did not end within {timeout_s:.0f}s:\n{out[-4000:]}") from None
    return out


def test_train_on_slurm_survives_a_cancelled_server(slurm_cluster, tiny_model, tmp_path):
    began = time.monotonic()
    # Enough steps that the run outlives the cancelled job's eviction (a step of the tiny model
    # takes well under 0.1 s; noticing the job's end takes a few seconds).
    proc = _start(slurm_cluster, tmp_path, tiny_model, steps=STEPS, rollout={"backend": "tandem:d2", "min_servers": 1},
                  slurm={"server_nodes": slurm_cluster.host, "trainer_nodes": slurm_cluster.host})
    try:
        _wait_for_step(proc, tmp_path, 1)
        jobs = _jobs(slurm_cluster)
        names = sorted(jobs)
        assert len(names) == 3 and all(re.fullmatch(r"tandem-[0-9a-f]{8}-(rollout-[01]|actor)", n) for n in names), names
        cancelled = next(job for name, job in jobs.items() if name.endswith("rollout-1"))
        subprocess.run(["scancel", cancelled], env=slurm_cluster.env, check=True, timeout=30)
        left = rf"rollout-1 \(\S+\) exited \(.*Slurm job {cancelled} CANCELLED.*\); it leaves the fleet"
        deadline = time.monotonic() + 120
        while not re.search(left, (run_dir(tmp_path) / "logs" / "controller.log").read_text()):
            assert proc.poll() is None, f"the run ended before rollout-1 left the fleet:\n{proc.stdout.read()[-4000:]}"
            assert time.monotonic() < deadline, "rollout-1 did not leave the fleet within 120 s of its job's cancel"
            time.sleep(0.1)
        evicted_at = max((r["step"] for r in rl_rows(tmp_path)), default=0)
        out = _finish(proc)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
    print(f"{STEPS} steps on Slurm, rollout-1's job {cancelled} cancelled after step 1, gone by step {evicted_at}: "
          f"{time.monotonic() - began:.1f}s")
    assert proc.returncode == 0, out[-4000:]
    assert [r["step"] for r in rl_rows(tmp_path)] == list(range(1, STEPS + 1))
    log = (run_dir(tmp_path) / "logs" / "controller.log").read_text()
    # tandem train prints the placement, role -> job and node
    for role in ("rollout-0", "rollout-1", "actor-rank0"):
        assert re.search(rf"placement: {role} -> .*Slurm job \d+\.\S+ on \S+", log), (role, log[-3000:])
    assert rl_rows(tmp_path)[-1]["sync/servers"] == 1.0  # the last updates reached the one server left
    assert not _jobs(slurm_cluster), "jobs of the run are still running after it"


def test_cancelling_the_trainer_job_ends_the_run_naming_it(slurm_cluster, tiny_model, tmp_path):
    proc = _start(slurm_cluster, tmp_path, tiny_model, steps=50, rollout={"backend": "tandem:d1"})
    try:
        _wait_for_step(proc, tmp_path, 1)
        trainer = next(job for name, job in _jobs(slurm_cluster).items() if name.endswith("-actor"))
        cancelled_at = time.monotonic()
        subprocess.run(["scancel", trainer], env=slurm_cluster.env, check=True, timeout=30)
        out = _finish(proc, timeout_s=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
    print(f"the run ended {time.monotonic() - cancelled_at:.1f}s after scancel of the trainer's job {trainer}")
    assert proc.returncode != 0
    assert "actor-rank0" in out and f"Slurm job {trainer} CANCELLED" in out, out[-4000:]
    assert len(rl_rows(tmp_path)) < 50
    assert not _jobs(slurm_cluster), "jobs of the run are still running after it"


def test_a_reward_model_fleet_runs_as_slurm_jobs(slurm_cluster, tiny_model, tmp_path):
    """`reward_model.backend=tandem:d1` on Slurm: the reward server is a job of its own beside the
    rollout server's and the trainer's, every episode is scored by it, and no job outlives the run."""
    from tests.inference.test_classifier_serving import _hf_classifier

    rm = _hf_classifier(tmp_path, "rm", "sequence", 1)
    proc = _start(slurm_cluster, tmp_path, tiny_model, steps=3, rollout={"backend": "tandem:d1"},
                  reward_model={"path": str(rm), "backend": "tandem:d1", "server_args": ["--num-threads", "1"]})
    try:
        _wait_for_step(proc, tmp_path, 1)
        names = sorted(_jobs(slurm_cluster))
        out = _finish(proc)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
    assert proc.returncode == 0, out[-4000:]
    assert len(names) == 3 and any(n.endswith("-reward_model-0") for n in names), names
    rows = rl_rows(tmp_path)
    assert [r["step"] for r in rows] == [1, 2, 3] and rows[-1]["reward_model/scored_total"] >= 3 * 4 * 2
    log = (run_dir(tmp_path) / "logs" / "controller.log").read_text()
    assert re.search(r"placement: reward_model-0 -> .*Slurm job \d+\.\S+ on \S+", log), log[-3000:]
    assert not _jobs(slurm_cluster), "jobs of the run are still running after it"


def test_a_role_slurm_cannot_place_fails_at_its_deadline_saying_why(slurm_cluster, tiny_model, tmp_path):
    began = time.monotonic()
    cfg = write_config(tmp_path, tiny_model, actor={"backend": "archon:d1"}, rollout={"backend": "tandem:d1"},
                       scheduler={"type": "slurm", "start_timeout_s": 15,
                                  "slurm": {"cpus_per_task": 64}})  # more than the node has: it queues
    proc = subprocess.run([TANDEM, "train", str(cfg)], env={**os.environ, **CHILD_ENV, **slurm_cluster.env},
                          capture_output=True, text=True, timeout=120)
    out = proc.stdout + proc.stderr
    print(f"a job Slurm cannot place: the run failed after {time.monotonic() - began:.1f}s")
    assert proc.returncode != 0
    assert re.search(r"rollout-0 .*did not print its listening line within 15s; Slurm: job \d+ PENDING", out), out[-3000:]
    assert not _queued(slurm_cluster), "the queued job outlived the run"


def _queued(cluster) -> list[str]:
    out = subprocess.run(["squeue", "--noheader", "--format", "%i %j %T"], env=cluster.env, capture_output=True,
                         text=True, timeout=30, check=True).stdout
    return out.splitlines()

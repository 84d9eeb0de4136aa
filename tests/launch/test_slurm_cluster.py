"""The single-node Slurm cluster the scheduler tests run against (issue 24): real `slurmctld`,
`slurmd` and `munged`, started by the fixture on 127.0.0.1; a batch job runs to COMPLETED, and
`scancel` ends a running one (CANCELLED, its process gone)."""

from __future__ import annotations

import os
import subprocess
import time

import pytest

from tests.launch.slurm_cluster import SlurmCluster


@pytest.fixture
def cluster(slurm_cluster):
    return slurm_cluster


def submit(cluster: SlurmCluster, script: str, out) -> str:
    proc = subprocess.run(["sbatch", "--parsable", "-o", str(out), "--wrap", script], env=cluster.env,
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip().split(";")[0]


def wait_state(cluster: SlurmCluster, job: str, states: set[str], timeout_s: float = 60) -> str:
    deadline = time.monotonic() + timeout_s
    while (state := cluster.job_state(job)) not in states:
        assert time.monotonic() < deadline, f"job {job} is {state}, not {states}"
        time.sleep(0.2)
    return state


def test_a_batch_job_runs_on_the_node(cluster, tmp_path):
    out = tmp_path / "out.txt"
    job = submit(cluster, 'echo "$SLURM_JOB_ID $SLURMD_NODENAME"', out)
    assert wait_state(cluster, job, {"COMPLETED", "FAILED", "CANCELLED"}) == "COMPLETED"
    assert out.read_text().split() == [job, cluster.host]


def test_scancel_ends_a_running_job(cluster, tmp_path):
    pid_file = tmp_path / "pid"
    job = submit(cluster, f"echo $$ > {pid_file}; exec sleep 300", tmp_path / "out.txt")
    wait_state(cluster, job, {"RUNNING"})
    deadline = time.monotonic() + 30
    while not pid_file.exists() or not pid_file.read_text().strip():
        assert time.monotonic() < deadline
        time.sleep(0.1)
    pid = int(pid_file.read_text())
    subprocess.run(["scancel", job], env=cluster.env, check=True, timeout=30)
    assert wait_state(cluster, job, {"CANCELLED", "COMPLETED", "FAILED"}) == "CANCELLED"
    deadline = time.monotonic() + 30
    while os.path.exists(f"/proc/{pid}"):
        assert time.monotonic() < deadline, "the cancelled job's process is still running"
        time.sleep(0.1)

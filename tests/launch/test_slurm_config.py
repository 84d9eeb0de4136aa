"""The `scheduler.*` keys of a Slurm launch, shown on the `srun` command lines the scheduler runs.
Slurm's commands are stood in for by scripts on PATH (`srun` records its arguments and exits;
`squeue`, `scancel`, `scontrol` do nothing), so the roles fail to start and every run is over in
seconds, after the command lines were recorded. A real Slurm runs them in
test_slurm_scheduler.py."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tandem.launch import LaunchError, LocalScheduler
from tandem.launch.factory import make_scheduler
from tandem.launch.slurm import SlurmScheduler
from tandem.rl.config import load_run_config
from tests.launch.helpers import CPU, HELPERS

SRUN = """#!/bin/sh
# Stands in for srun: records its arguments, one per line, then exits as a failed job would.
printf '%s\\n' "$@" > "{record}/srun-$$.args"
exit 1
"""


@pytest.fixture
def fake_slurm(tmp_path, monkeypatch) -> Path:
    """A directory that receives one `srun-<pid>.args` file per srun run."""
    bin_dir, record = tmp_path / "bin", tmp_path / "record"
    bin_dir.mkdir()
    record.mkdir()
    (bin_dir / "srun").write_text(SRUN.format(record=record))
    for name in ("squeue", "scancel", "scontrol"):
        (bin_dir / name).write_text("#!/bin/sh\nexit 0\n")
    for script in bin_dir.iterdir():
        script.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)  # not inside an allocation
    return record


def _sruns(record: Path) -> list[list[str]]:
    return [p.read_text().splitlines() for p in sorted(record.glob("srun-*.args"))]


def _option(args: list[str], name: str) -> str | None:
    return args[args.index(name) + 1] if name in args else None


def test_slurm_keys_are_on_every_srun(tmp_path, fake_slurm):
    """Catches a `scheduler.slurm.*` key (partition, account, server_nodes, trainer_nodes,
    cpus_per_task, srun_args) not reaching the srun of the roles it is for."""
    cfg = load_run_config(None, ["scheduler.type=slurm", "scheduler.slurm.partition=gpu-p", "scheduler.slurm.account=acct7",
                                 "scheduler.slurm.server_nodes=node-s", "scheduler.slurm.trainer_nodes=node-t",
                                 "scheduler.slurm.cpus_per_task=3", "scheduler.slurm.srun_args=['--time=00:05:00']"])
    scheduler = make_scheduler(cfg.scheduler, tmp_path / "run")
    assert isinstance(scheduler, SlurmScheduler)
    with scheduler:
        with pytest.raises(LaunchError):
            scheduler.start_servers(1, "/no/model", timeout_s=30)
        with pytest.raises(LaunchError):
            scheduler.start_workers("archon:d2", HELPERS, args=CPU, timeout_s=30)
    server, ranks = sorted(_sruns(fake_slurm), key=lambda a: _option(a, "--ntasks") or "")
    assert _option(server, "--ntasks") == "1" and _option(ranks, "--ntasks") == "2"
    for args in (server, ranks):
        assert _option(args, "--partition") == "gpu-p" and _option(args, "--account") == "acct7"
        assert _option(args, "--cpus-per-task") == "3" and "--time=00:05:00" in args
    assert _option(server, "--nodelist") == "node-s" and _option(ranks, "--nodelist") == "node-t"


def test_default_slurm_launch_names_no_partition_account_or_nodes(tmp_path, fake_slurm):
    """The other side of the test above: without the keys srun gets none of those options."""
    cfg = load_run_config(None, ["scheduler.type=slurm"])
    with make_scheduler(cfg.scheduler, tmp_path / "run") as scheduler, pytest.raises(LaunchError):
        scheduler.start_servers(1, "/no/model", timeout_s=30)
    (server,) = _sruns(fake_slurm)
    assert [_option(server, o) for o in ("--partition", "--account", "--nodelist")] == [None, None, None]
    assert _option(server, "--cpus-per-task") == "1"


def test_scheduler_type_picks_the_scheduler(tmp_path, fake_slurm):
    """Catches `scheduler.type` not choosing the scheduler: local processes, or srun jobs (Ray:
    test_ray_scheduler.py, which needs root for its network namespace)."""
    assert isinstance(make_scheduler(load_run_config(None).scheduler, tmp_path / "a"), LocalScheduler)
    assert isinstance(make_scheduler(load_run_config(None, ["scheduler.type=slurm"]).scheduler, tmp_path / "b"),
                      SlurmScheduler)

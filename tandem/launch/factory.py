"""`make_scheduler`: the scheduler a run's `scheduler` section names."""

from __future__ import annotations

from pathlib import Path

from tandem.launch.config import SchedulerConfig
from tandem.launch.local import LocalScheduler
from tandem.launch.process_scheduler import ProcessScheduler
from tandem.launch.scheduler import RunProcesses
from tandem.launch.slurm import SlurmScheduler


def make_scheduler(config: SchedulerConfig, run_dir: str | Path, *, host: str = "127.0.0.1",
                   processes: RunProcesses | None = None) -> ProcessScheduler:
    """The scheduler `config` names, logging to `run_dir/logs`; `host` is the controller's address
    as the processes reach it (`cluster.host_ip`); `processes` what the run will start (a private
    Ray cluster is sized to hold it; `tandem.rl.cluster.run_processes` counts a run config's)."""
    if config.type == "ray":
        from tandem.launch.ray_cluster import RayScheduler  # Ray: seconds to import, and optional

        return RayScheduler(run_dir, config.ray, host=host, processes=processes)
    if config.type == "slurm":
        return SlurmScheduler(run_dir, config.slurm, host=host)
    return LocalScheduler(run_dir)

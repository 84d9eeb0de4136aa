"""The `scheduler` section: where a run's processes are started (local, Ray, Slurm); `make_scheduler`
(`tandem.launch.factory`) turns it into a scheduler. See docs/launch.md for the worked examples."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tandem.config.fields import config_field as _f
from tandem.errors import ConfigError

if TYPE_CHECKING:
    from tandem.launch.scheduler import RunProcesses

RAY_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")


@dataclass
class RaySchedulerConfig:
    address: str | None = _f(None, "Ray cluster to join: 'auto' (the cluster this machine belongs to, as "
                                   "`ray start` left it), 'HOST:PORT' of its head, or None to start a private "
                                   "one in this process (stopped with the run).")
    strategy: str = _f("PACK", "Placement group strategy of each role's bundles (one bundle per process).",
                       choices=RAY_STRATEGIES)
    cpus_per_process: float = _f(1.0, "Logical CPUs each server and trainer rank reserves in its bundle.", gt=0.0)
    num_cpus: int = _f(0, "CPUs of a private cluster (address=None); 0: this machine's count, raised to what the "
                          "run's servers and trainer ranks reserve (cpus_per_process each), which then share the "
                          "machine's cores as the local scheduler's processes do.", min=0)
    namespace: str = _f("tandem", "Ray namespace of the run's actors.")

    def private_cpus(self, processes: RunProcesses | None, machine_cpus: int) -> int:
        """CPUs of the private cluster Tandem starts: `num_cpus` when set (honoured as given: a
        placement it can never hold is refused when asked for); else the machine's `machine_cpus`,
        raised to the bundles `processes` reserve, `cpus_per_process` each."""
        if self.num_cpus:
            return self.num_cpus
        return max(machine_cpus, self.cpus_needed(processes), 1)

    def cpus_needed(self, processes: RunProcesses | None) -> int:
        """Whole CPUs the bundles of `processes` reserve in all (0 when unknown)."""
        if processes is None:
            return 0
        return math.ceil(processes.count * self.cpus_per_process - 1e-9)


@dataclass
class SlurmSchedulerConfig:
    partition: str | None = _f(None, "Partition of every job (None: the cluster's default).")
    account: str | None = _f(None, "Account charged (None: the user's default).")
    server_nodes: str | None = _f(None, "Nodes the inference servers run on (--nodelist, e.g. 'gpu[01-02]').")
    trainer_nodes: str | None = _f(None, "Nodes the trainer ranks run on (--nodelist).")
    cpus_per_task: int = _f(1, "CPUs of each server and trainer rank (--cpus-per-task).", min=1)
    srun_args: list[str] = field(default_factory=list, metadata={
        "help": "Extra srun options for every role, e.g. ['--time=04:00:00', '--mem=32G']."})


@dataclass
class SchedulerConfig:
    type: str = _f("local", "local: processes on this machine; ray: Ray actors in placement groups; slurm: one "
                            "srun job (or job step, inside an allocation) per role.",
                   choices=("local", "ray", "slurm"))
    start_timeout_s: float = _f(180.0, "Seconds each role may take to start: queueing for Slurm nodes or Ray "
                                       "resources included.", gt=0.0)
    ray: RaySchedulerConfig = field(default_factory=RaySchedulerConfig)
    slurm: SlurmSchedulerConfig = field(default_factory=SlurmSchedulerConfig)

    @property
    def remote(self) -> bool:
        """True when processes may run on other hosts (they reach the controller at cluster.host_ip)."""
        return self.type != "local"

    def check(self, prefix: str = "scheduler.") -> None:
        if self.type == "ray":
            try:
                import ray  # noqa: F401
            except ImportError:
                raise ConfigError(f"{prefix}type=ray needs Ray in this environment: pip install 'ray>=2.40'") from None
        if self.type == "slurm":
            import shutil

            missing = [c for c in ("srun", "squeue", "scancel", "scontrol") if shutil.which(c) is None]
            if missing:
                raise ConfigError(f"{prefix}type=slurm needs Slurm's commands on PATH ({', '.join(missing)} not "
                                  f"found): run on a Slurm login or compute node")

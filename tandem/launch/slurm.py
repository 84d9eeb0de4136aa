"""`SlurmScheduler`: every role is a Slurm job started with `srun` (a job step when the controller
itself runs inside an allocation, e.g. an `sbatch` script).

`srun` runs as this process's child under `tandem.launch.guard`: its exit is the role's end, its
output the role's log, and it dies with the controller. Worker tasks take RANK / LOCAL_RANK /
WORLD_SIZE from Slurm's task ids; job states come from `squeue` / `scontrol`, and teardown
SIGTERMs every `srun`, then `scancel`s the jobs. See docs/launch.md, "Slurm"."""

from __future__ import annotations

import contextlib
import logging
import os
import re
import secrets
import shlex
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from tandem.launch.config import SlurmSchedulerConfig
from tandem.launch.process import LaunchedProcess, ManagedProcess, describe_process
from tandem.launch.process_scheduler import ProcessScheduler
from tandem.launch.rpc_server import ENV_NAME, ENV_PLACEMENT

logger = logging.getLogger("tandem.launch")
JOB_LINE = re.compile(r"tandem-slurm: job (\d+) step (\S+) node (\S+) task (\d+)")
# What slurmstepd writes into a step's output when Slurm ends it (scancel, time limit, ...).
STEPD_LINE = re.compile(r"\*\*\* (?:STEP|JOB) \S+ ON \S+ (.+?) \*\*\*")
_COMMAND_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class SlurmJob:
    job_id: str
    step: str
    node: str


def _slurm(*args: str) -> str:
    """stdout of a Slurm command ('' when it fails: the controller may be unreachable for a moment)."""
    try:
        out = subprocess.run(args, capture_output=True, text=True, timeout=_COMMAND_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return out.stdout if out.returncode == 0 else ""


def job_state(job_id: str, settle_s: float = 0.0) -> str:
    """'CANCELLED', 'RUNNING', ... from `scontrol show job`, with the reason when there is one.
    `settle_s`: how long to wait for a job still COMPLETING to reach its final state (Slurm tells
    no one; it is asked every 0.1 s)."""
    deadline = time.monotonic() + settle_s
    while True:
        fields = dict(f.split("=", 1) for f in _slurm("scontrol", "show", "job", job_id).split() if "=" in f)
        state = fields.get("JobState", "")
        if state != "COMPLETING" or time.monotonic() >= deadline:
            break
        time.sleep(0.1)
    reason = fields.get("Reason", "None")
    return f"{state} ({reason})" if state and reason not in ("None", "") else state


class SrunProcess(ManagedProcess):
    """One role's `srun`: a local child whose output is its tasks', named by a job name."""

    def __init__(self, name: str, job_name: str, cmd: list[str], log_path: Path, env: dict[str, str],
                 log_start: int):
        self.job_name = job_name
        self._job: SlurmJob | None = None
        super().__init__(name, cmd, log_path, env, log_start=log_start)

    def job(self) -> SlurmJob | None:
        """The job, step and node, once the first task said so in the log."""
        if self._job is None:
            for line in self.log_tail(2000).splitlines():
                if (m := JOB_LINE.search(line)) is not None:
                    self._job = SlurmJob(m.group(1), m.group(2), m.group(3))
                    break
        return self._job

    @property
    def placement(self) -> str:
        job = self.job()
        return f"Slurm job {job.job_id}.{job.step} on {job.node}" if job else f"Slurm job {self.job_name} (not started)"

    def exit_status(self, wait_s: float = 0.0) -> str:
        status = super().exit_status(wait_s)
        job = self.job()
        if job is None or status == "still running":
            return status
        ended = [m.group(1) for m in map(STEPD_LINE.search, self.log_tail(20).splitlines()) if m]
        state = ended[-1] if ended else job_state(job.job_id, settle_s=1.0)
        return f"{status}; Slurm job {job.job_id} {state}" if state else status

    def waiting_reason(self) -> str:
        queued = _slurm("squeue", "--noheader", "--name", self.job_name, "--format", "%i %T %R").strip()
        return f"; Slurm: job {queued}" if queued else ""


class SlurmRank:
    """Rank r of a group's `srun`: the srun's life and status, the log lines labelled `r: `."""

    def __init__(self, srun: SrunProcess, rank: int):
        self.srun, self.rank = srun, rank
        self.name = f"{srun.name}-rank{rank}"
        self.pid: int | None = None  # on its node, from its hello
        self.log_path, self.log_start, self.started = srun.log_path, srun.log_start, srun.started
        self._sentinel = os.dup(srun.sentinel)  # each rank needs a descriptor of its own to wait on
        self._placement = ""
        self._label = re.compile(rf"^\s*{rank}: ")

    @property
    def sentinel(self) -> int:
        return self._sentinel

    @property
    def placement(self) -> str:
        return self._placement or self.srun.placement

    def placed(self, hostname: str, address: str, pid: int, where: str) -> None:
        self.pid = pid
        self._placement = f"{hostname} ({address}), pid {pid}" + (f", {where}" if where else "")

    def poll(self) -> int | None:
        return self.srun.poll()

    def exit_status(self, wait_s: float = 0.0) -> str:
        return self.srun.exit_status(wait_s)

    def log_tail(self, lines: int = 40) -> str:
        mine = [self._label.sub("", line) for line in self.srun.log_tail(lines * 8).splitlines()
                if self._label.match(line)]
        return "\n".join(mine[-lines:]) or self.srun.log_tail(lines)

    def describe(self, what: str, lines: int = 40) -> str:
        return describe_process(self, what, lines)

    def waiting_reason(self) -> str:
        return self.srun.waiting_reason()

    def signal_group(self, sig: int) -> None:
        self.srun.signal_group(sig)

    def group_alive(self) -> bool:
        return self.srun.group_alive()

    def reap(self, timeout_s: float) -> None:
        self.srun.reap(timeout_s)

    def release(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self._sentinel)
        self._sentinel = -1


# Each task says where it runs, then (worker groups) takes its rank from Slurm's task ids.
_TASK_PRELUDE = 'echo "tandem-slurm: job $SLURM_JOB_ID step $SLURM_STEP_ID node $SLURMD_NODENAME task $SLURM_PROCID"'
_RANK_EXPORTS = ('export RANK=$SLURM_PROCID LOCAL_RANK=$SLURM_LOCALID WORLD_SIZE=$SLURM_NTASKS '
                 'LOCAL_WORLD_SIZE=${SLURM_STEP_TASKS_PER_NODE%%(*} '
                 f'{ENV_PLACEMENT}="Slurm job $SLURM_JOB_ID.$SLURM_STEP_ID on $SLURMD_NODENAME" '
                 f'{ENV_NAME}="$TANDEM_GROUP_NAME-rank$SLURM_PROCID"')


class SlurmScheduler(ProcessScheduler):
    """Roles as `srun` jobs (see the module docstring); `config` is `scheduler.slurm`, `host` the
    controller's address as the nodes reach it (`cluster.host_ip`)."""

    def __init__(self, run_dir: str | Path | None, config: SlurmSchedulerConfig, *, host: str = "127.0.0.1",
                 **kwargs: object):
        super().__init__(run_dir, host=host, **kwargs)  # type: ignore[arg-type]
        self.config = config
        self.run_tag = secrets.token_hex(4)  # job names of this launch: tandem-<tag>-<role>
        self.in_allocation = "SLURM_JOB_ID" in os.environ  # srun then starts steps of that job

    def _srun(self, name: str, ntasks: int, nodes: str | None, gpus: int, prelude: str, cmd: list[str],
              env: dict[str, str], *, label: bool) -> SrunProcess:
        c = self.config
        job_name = f"tandem-{self.run_tag}-{name}"
        srun = ["srun", "--job-name", job_name, "--ntasks", str(ntasks), "--cpus-per-task", str(c.cpus_per_task),
                "--kill-on-bad-exit=1", "--export=ALL"]
        if label:
            srun.append("--label")
        if c.partition:
            srun += ["--partition", c.partition]
        if c.account:
            srun += ["--account", c.account]
        if nodes:
            srun += ["--nodelist", nodes]
        if gpus:
            srun += ["--gpus-per-task", str(gpus)]
        srun += [*c.srun_args, "bash", "-c", f'{prelude}; exec "$@"', "tandem-task", *cmd]
        full = [self.python, "-m", "tandem.launch.guard", str(os.getpid()), "--", *srun]
        log, start = self._log_file(name, full)
        with self._lock:
            proc = SrunProcess(name, job_name, full, log, env, start)
            self.processes.append(proc)
        logger.info("%s: %s", name, shlex.join(srun[:srun.index("bash")]))
        return proc

    def _launch_server(self, name: str, cmd: list[str], env: dict[str, str], devices: list[int],
                       device: str) -> LaunchedProcess:
        gpus = len(devices) if device == "cuda" else 0
        return self._srun(name, 1, self.config.server_nodes, gpus, _TASK_PRELUDE, cmd, env, label=False)

    def _launch_ranks(self, name: str, cmd: list[str], envs: list[dict[str, str]], devices: list[int],
                      device: str) -> list[LaunchedProcess]:
        env = {k: v for k, v in envs[0].items() if k not in ("RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", ENV_NAME)}
        env["TANDEM_GROUP_NAME"] = name
        gpus = 1 if device == "cuda" else 0
        srun = self._srun(name, len(envs), self.config.trainer_nodes, gpus, f"{_TASK_PRELUDE}; {_RANK_EXPORTS}",
                          cmd, env, label=True)
        return [SlurmRank(srun, r) for r in range(len(envs))]

    def _cleanup(self) -> None:
        """`scancel` what the sruns left: the job each started (by its name: also one still
        queued, which printed no job id yet), or its step inside an allocation."""
        steps = []
        for proc in self.processes:
            if not isinstance(proc, SrunProcess):
                continue
            if not self.in_allocation:
                _slurm("scancel", "--name", proc.job_name)
            elif (job := proc.job()) is not None:
                steps.append(f"{job.job_id}.{job.step}")
        if steps:
            _slurm("scancel", *steps)

    def __enter__(self) -> SlurmScheduler:
        return self

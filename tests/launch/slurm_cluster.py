"""A real single-node Slurm cluster for tests: Debian's `slurm-wlm` and `munge` (`make slurm-deps`
installs them), `munged`, `slurmctld` and `slurmd` started in a directory of their own with a
`slurm.conf` written for this machine, every daemon on 127.0.0.1 and on ports picked free.

    with SlurmCluster(tmp_path) as cluster:
        subprocess.run(["sbatch", "--wrap", "true"], env=cluster.env)

`SlurmCluster.unavailable()` says why one cannot run here (None when it can); the fixture skips
with that reason. The daemons stop, and every job is cancelled, when the cluster closes.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

from tandem.launch.process import free_port

DAEMONS = ("munged", "slurmctld", "slurmd")
ROOT = Path(__file__).resolve().parents[2]


def _conf(root: Path, host: str, cpus: int) -> str:
    return f"""\
ClusterName=tandemtest
SlurmctldHost={host}(127.0.0.1)
SlurmUser=root
SlurmdUser=root
SlurmctldPort={free_port()}
SlurmdPort={free_port()}
AuthType=auth/munge
AuthInfo=socket={root}/munge.sock
CredType=cred/munge
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SwitchType=switch/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
MinJobAge=3600
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
NodeName={host} NodeAddr=127.0.0.1 CPUs={cpus} RealMemory=4000 State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:8
"""


class SlurmCluster:
    def __init__(self, root: Path):
        self.root = Path(root)
        self.host = socket.gethostname().split(".")[0]
        self.env = {**os.environ, "SLURM_CONF": str(self.root / "slurm.conf")}

    @staticmethod
    def unavailable() -> str | None:
        missing = [d for d in DAEMONS if shutil.which(d) is None]
        if missing:
            failed = ROOT / ".slurm.failed"
            why = failed.read_text().strip() if failed.exists() else "run `make slurm-deps`"
            return f"{', '.join(missing)} not installed ({why})"
        if os.geteuid() != 0:
            return "a test Slurm cluster runs its daemons as root (SlurmUser=root)"
        return None

    def __enter__(self) -> SlurmCluster:
        for sub in ("state", "spool"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        key = self.root / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        (self.root / "slurm.conf").write_text(_conf(self.root, self.host, os.cpu_count() or 2))
        try:
            self._run(["munged", "--force", f"--key-file={key}", f"--socket={self.root}/munge.sock",
                       f"--pid-file={self.root}/munged.pid", f"--log-file={self.root}/munged.log",
                       f"--seed-file={self.root}/munge.seed"])
            self._run(["slurmctld"])
            self._run(["slurmd"])
            self._wait_idle(60)
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _run(self, cmd: list[str]) -> None:
        proc = subprocess.run(cmd, env=self.env, capture_output=True, text=True, timeout=60)
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stderr.strip()}{self._logs()}")

    def _wait_idle(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        state = ""
        while time.monotonic() < deadline:
            out = subprocess.run(["sinfo", "-h", "-N", "-o", "%T"], env=self.env, capture_output=True, text=True,
                                 timeout=30)
            state = out.stdout.strip()
            if state in ("idle", "mixed", "allocated"):
                return
            time.sleep(0.2)
        raise RuntimeError(f"the Slurm node is {state or 'not reporting'} after {timeout_s:.0f}s{self._logs()}")

    def _logs(self) -> str:
        tails = []
        for name in ("slurmctld.log", "slurmd.log", "munged.log"):
            path = self.root / name
            if path.exists():
                tails.append(f"\n--- {name}:\n" + "\n".join(path.read_text(errors="replace").splitlines()[-15:]))
        return "".join(tails)

    def job_state(self, job_id: str) -> str:
        """PENDING, RUNNING, COMPLETED, CANCELLED, FAILED, ... (`scontrol show job`)."""
        out = subprocess.run(["scontrol", "show", "job", job_id], env=self.env, capture_output=True, text=True,
                             timeout=30)
        for field in out.stdout.split():
            if field.startswith("JobState="):
                return field.removeprefix("JobState=")
        return "UNKNOWN"

    def close(self) -> None:
        """Cancel every job, then stop the daemons (SIGTERM, SIGKILL after 10 s)."""
        if shutil.which("scancel") and (self.root / "slurmctld.pid").exists():
            subprocess.run(["scancel", "--full", "--user", "root"], env=self.env, capture_output=True, timeout=30)
        for name in ("slurmd", "slurmctld", "munged"):
            pid_file = self.root / f"{name}.pid"
            try:
                pid = int(pid_file.read_text().strip())
            except (OSError, ValueError):
                continue
            _stop(pid)


def _stop(pid: int, grace_s: float = 10.0) -> None:
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)

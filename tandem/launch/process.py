"""What a scheduler sees of a process it started, and one child process of this one.

`LaunchedProcess` is the interface every scheduler's processes have (the RPC layer needs its
`WorkerProcess` subset): a sentinel to wait on, exit status, the lines this launch wrote to its log
(a role's log is appended to by every launch into the same run directory), signals to its process
group, and where it runs. `ManagedProcess` is the local one: a child in its own session, its output
in a log file, a pidfd as its sentinel (`LocalScheduler`, and `srun` for `SlurmScheduler`).
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Protocol


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def describe_returncode(rc: int | None) -> str:
    if rc is None:
        return "still running"
    if rc < 0:
        try:
            return f"killed by {signal.Signals(-rc).name}"
        except ValueError:
            return f"killed by signal {-rc}"
    return f"exit code {rc}"


def process_group_alive(pgid: int) -> bool:
    """True while any process of the group `pgid` exists."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def read_log_tail(path: Path, start: int, lines: int) -> str:
    """The last `lines` lines of `path` after byte `start` (a launch's own lines)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(start, f.tell() - 64 * 1024))
            text = f.read().decode("utf-8", errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


def describe_process(proc: LaunchedProcess, what: str, lines: int) -> str:
    """'NAME (pid N) WHAT; log PATH' and the last `lines` lines it wrote; where it ran, unless here."""
    where = "" if proc.placement.startswith("this host") else f", {proc.placement}"
    return (f"{proc.name} (pid {proc.pid}{where}) {what}; log {proc.log_path}\n"
            f"--- last lines of its log ---\n{proc.log_tail(lines).rstrip()}")


class LaunchedProcess(Protocol):
    """One process of a role, wherever a scheduler started it."""

    name: str  # the role, e.g. rollout-0, actor-rank1
    pid: int | None  # on its own host
    log_path: Path
    log_start: int  # where this launch's lines begin in log_path
    started: float  # time.monotonic() at launch

    @property
    def placement(self) -> str:
        """Where it runs, in words ("this host, pid 12", "Slurm job 34.0 on node1")."""
        ...

    @property
    def sentinel(self) -> int:
        """A descriptor that becomes readable once the process has ended (-1 once released)."""
        ...

    def poll(self) -> int | None: ...
    def exit_status(self, wait_s: float = 0.0) -> str: ...
    def log_tail(self, lines: int = 40) -> str: ...
    def describe(self, what: str, lines: int = 40) -> str: ...
    def signal_group(self, sig: int) -> None: ...
    def group_alive(self) -> bool: ...
    def reap(self, timeout_s: float) -> None: ...
    def release(self) -> None: ...

    def waiting_reason(self) -> str:
        """Why it may not have started yet ('; job 12 is PENDING (Resources)'), or ''."""
        ...

    def placed(self, hostname: str, address: str, pid: int, where: str) -> None:
        """What the process said of itself once it ran (a worker rank's hello)."""
        ...


class ManagedProcess:
    """A child in its own session with its output in a log file, and a pidfd as its sentinel."""

    def __init__(self, name: str, cmd: Sequence[str], log_path: Path, env: Mapping[str, str], *,
                 cwd: str | Path | None = None, pass_fds: Sequence[int] = (), log_start: int | None = None):
        """`log_start`: where this launch's lines begin in `log_path`, which earlier launches of the
        same role may have filled (default: its current end). Log reads never look before it."""
        self.name, self.cmd, self.log_path = name, list(cmd), log_path
        if log_start is None:
            log_start = log_path.stat().st_size if log_path.exists() else 0
        self.log_start = log_start
        self._life_r: int | None = None
        fds = list(pass_fds)
        if not hasattr(os, "pidfd_open"):  # fallback sentinel: a pipe whose write end only the child holds
            self._life_r, life_w = os.pipe()
            fds.append(life_w)
        with open(log_path, "ab") as log:
            self.popen = subprocess.Popen(self.cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                          env=dict(env), cwd=cwd, start_new_session=True, pass_fds=fds)
        self.pid: int | None = self.popen.pid
        if self._life_r is not None:
            os.close(fds[-1])
            self._sentinel = self._life_r
        else:
            self._sentinel = os.pidfd_open(self.popen.pid)
        self.started = time.monotonic()
        self._placement = f"this host, pid {self.pid}"

    @property
    def placement(self) -> str:
        return self._placement

    @property
    def sentinel(self) -> int:
        return self._sentinel

    def poll(self) -> int | None:
        return self.popen.poll()

    def exit_status(self, wait_s: float = 0.0) -> str:
        try:
            rc = self.popen.wait(timeout=wait_s) if wait_s > 0 else self.popen.poll()
        except subprocess.TimeoutExpired:
            rc = None
        return describe_returncode(rc)

    def log_tail(self, lines: int = 40) -> str:
        """The last `lines` lines this launch wrote (never an earlier launch's)."""
        return read_log_tail(self.log_path, self.log_start, lines)

    def describe(self, what: str, lines: int = 40) -> str:
        """'NAME (pid N) WHAT; log PATH' and the last `lines` lines this launch wrote."""
        return describe_process(self, what, lines)

    def signal_group(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.popen.pid, sig)

    def reap(self, timeout_s: float) -> None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(timeout=timeout_s)

    def waiting_reason(self) -> str:
        return ""

    def placed(self, hostname: str, address: str, pid: int, where: str) -> None:
        self._placement = f"this host, pid {pid}" if pid == self.pid else f"{hostname} ({address}), pid {pid}"
        if where:
            self._placement += f", {where}"

    def group_alive(self) -> bool:
        return process_group_alive(self.popen.pid)

    def release(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self._sentinel)
        self._sentinel = -1

    def __repr__(self) -> str:
        return f"ManagedProcess({self.name!r}, pid={self.pid}, {describe_returncode(self.poll())})"


_ERROR_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Interrupt): .*")


def last_error_line(proc: LaunchedProcess) -> str | None:
    """The last 'SomeError: message' line of a log (the exception a traceback ended with)."""
    for line in reversed(proc.log_tail(200).splitlines()):
        if _ERROR_LINE.match(line.strip()):
            return line.strip()
    return None

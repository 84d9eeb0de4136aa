"""One execution of a program in the sandbox: start it isolated, feed stdin, read stdout and stderr
up to the output limit, enforce the wall-clock limit, kill the whole tree on any limit, say why.

`execute` does not check that isolation works; `tandem.sandbox.run` and `SandboxPool` do that
first (`availability.require`)."""

from __future__ import annotations

import contextlib
import os
import re
import selectors
import signal
import subprocess
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from tandem.sandbox import cgroups
from tandem.sandbox.config import SandboxConfig
from tandem.sandbox.isolation import (
    HOST_PATH,
    OVERHEAD_PROCESSES,
    Tools,
    command,
    real_uid,
    uid_processes,
)

STATUSES = ("ok", "error", "timeout", "memory", "output", "processes", "refused")
_CHILD_PID = re.compile(rb'"child-pid":\s*(\d+)')  # in bwrap's --info-fd report
_CGROUP_MEMORY_SLACK = 32 * 2**20  # bwrap's own two processes and the kernel's share, beyond memory_mb


@dataclass
class Execution:
    """What one execution did. `status`: ok (exit 0), error (any other exit), timeout (wall-clock
    or CPU limit, a deadline, or a sandbox that did not start the program in time), memory, output (stdout or stderr passed the output limit), processes (a fork
    failed at the process limit), refused (not started: program or stdin too large). `reason`
    names the limit and its key when a limit stopped it. `exit_code` is the program's (128 + N
    when signal N killed it: 137 when the sandbox or a limit did), None when refused; stdout and
    stderr are cut at the output limit."""

    status: str
    exit_code: int | None
    stdout: str
    stderr: str
    reason: str | None
    seconds: float
    cpu_seconds: float | None = None  # the whole tree's, where cgroup v1 cpuacct is mounted
    # From the program's start (its namespaces made) to its end: what the wall limit bounds.
    # `seconds` adds the sandbox's setup, which a busy host can stretch. None: never started.
    program_seconds: float | None = None

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def to_json(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Deadline:
    """An end for an execution besides its wall limit: `at` (time.monotonic()), and what set it
    for the reason (e.g. "the reward call's time, task.reward_timeout_s=15 s")."""

    at: float
    what: str


def execute(program: str | Path, stdin: bytes | None, limits: SandboxConfig, tools: Tools, uid: int,
            deadline: Deadline | None = None) -> Execution:
    """Run `program` (source text, or a file's path) with `stdin` in a fresh sandbox as `uid` (a
    leased one: `tandem.sandbox.uids`), stopped at its wall limit or at `deadline`, whichever comes
    first; every process it started is gone when this returns."""
    source = Path(program).read_bytes() if isinstance(program, Path) else program.encode()
    data = stdin or b""
    for what, size in (("program", len(source)), ("stdin", len(data))):
        if size > limits.file_bytes:
            return Execution("refused", None, "", "", f"the {what} has {size} bytes, more than "
                             f"rollout.sandbox.file_bytes={limits.file_bytes}", 0.0)
    start = time.monotonic()
    if deadline is not None and deadline.at <= start:
        return Execution("timeout", None, "", "", f"the {deadline.what} ran out before the program started", 0.0)
    group = (cgroups.ExecutionGroup(uid, limits.memory_mb * 2**20 + _CGROUP_MEMORY_SLACK,
                                    limits.processes + OVERHEAD_PROCESSES) if cgroups.available() else None)
    program_fd, stdin_fd = _memfd("program", source), _memfd("stdin", data)
    info_r, info_w = os.pipe()
    try:
        if group is not None:
            group.create()
        argv = command(limits, tools, uid, program_fd, info_w, group.enter_script() if group else None)
        proc = subprocess.Popen(argv, stdin=stdin_fd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                pass_fds=(program_fd, info_w), env={"PATH": HOST_PATH}, cwd="/",
                                start_new_session=True)
    except BaseException:
        os.close(info_r)
        if group is not None:
            group.remove()
        raise
    finally:
        for fd in (program_fd, stdin_fd, info_w):
            os.close(fd)
    tree = _Tree(proc, info_r, uid)
    clock = _Clock(start, limits.wall_s, deadline)
    try:
        stdout, stderr, stopped = _collect(tree, limits, clock)
        code = _wait(proc, clock.end() if stopped is None else None)
        if code is None:
            stopped = clock.bound()
    finally:
        if proc.returncode is None:
            tree.kill()
            code = _wait(proc, None)
        ended = time.monotonic()
        os.close(info_r)
        # The program is its namespace's init: its death took the tree with it. The sweep
        # catches anything that got out of the namespace's reach regardless.
        if group is not None:
            group.kill_all()
        elif os.geteuid() == 0:
            for pid in uid_processes(uid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
    seconds = time.monotonic() - start
    ran = None if clock.started is None else round(ended - clock.started, 4)
    cpu = group.cpu_seconds() if group is not None else None
    try:
        status, reason = _classify(limits, stopped, code, stderr, group, deadline)
    finally:
        if group is not None:
            group.remove()
    return Execution(status, code, stdout.decode("utf-8", "replace"), stderr.decode("utf-8", "replace"),
                     reason, round(seconds, 4), None if cpu is None else round(cpu, 4), ran)


def _memfd(name: str, data: bytes) -> int:
    fd = os.memfd_create(f"tandem-sandbox-{name}", os.MFD_CLOEXEC)
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


class _Tree:
    """The process tree of one execution, and how to kill it: the program first (its host pid
    from bwrap's --info-fd, pinned by a pidfd), so that the outer bwrap reaps it and exits; the
    outer bwrap's process group (whose death kills the program, --die-with-parent) only when the
    program's pid is not known. Killing the outer bwrap first would orphan the program: a zombie
    until the host's pid 1 reaps it."""

    def __init__(self, proc: subprocess.Popen, info_fd: int, uid: int):
        self.proc, self.info_fd, self.uid = proc, info_fd, uid
        self.pid: int | None = None
        self._info = b""
        os.set_blocking(info_fd, False)

    def read_info(self) -> bool:
        """Read what bwrap has written of its report so far, and the program's pid once it is in
        it. bwrap writes the report in several pieces (the pid first, then the namespaces' ids) and
        then closes the fd: a read may see part of it. True once the fd is done with (closed)."""
        while True:
            try:
                chunk = os.read(self.info_fd, 65536)
            except BlockingIOError:
                return False
            if not chunk:
                return True
            self._info += chunk
            if self.pid is None and (found := _CHILD_PID.search(self._info)):
                self.pid = int(found.group(1))

    def program_pid(self) -> int | None:
        if self.pid is None:
            self.read_info()
        return self.pid

    def kill(self) -> None:
        pid = self.program_pid()
        if pid is not None:
            with contextlib.suppress(OSError):
                pidfd = os.pidfd_open(pid)
                try:
                    if real_uid(pid) == self.uid:  # still the program, not a pid reused since
                        signal.pidfd_send_signal(pidfd, signal.SIGKILL)
                finally:
                    os.close(pidfd)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=5.0)
                return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)


SETUP_S = 60.0  # how long the sandbox may take to start the program (namespaces, mounts)


class _Clock:
    """When an execution must end. The wall limit counts from the program's start, which bwrap
    reports on --info-fd once its namespaces exist: on a host busy making and destroying network
    namespaces that took 13 s once (a suite run at 25ec077), and a trivial program must not time out
    for it. Until then the start itself is bounded by SETUP_S; a `Deadline` bounds both."""

    def __init__(self, start: float, wall_s: float, deadline: Deadline | None):
        self.start, self.wall_s, self.deadline = start, wall_s, deadline
        self.started: float | None = None

    def end(self) -> float:
        end = self.start + SETUP_S if self.started is None else self.started + self.wall_s
        return end if self.deadline is None else min(end, self.deadline.at)

    def bound(self) -> str:
        """Which limit the end is: 'deadline', 'setup' (the program never started) or 'wall'."""
        if self.deadline is not None and self.end() >= self.deadline.at:
            return "deadline"
        return "setup" if self.started is None else "wall"


def _collect(tree: _Tree, limits: SandboxConfig, clock: _Clock) -> tuple[bytes, bytes, str | None]:
    """Read stdout and stderr until both close, the clock's end passes (its bound: 'wall',
    'setup', 'deadline') or one passes the output limit ('output'); the tree is killed in the last
    two cases. Notes the program's start (and pid) from bwrap's --info-fd on the way."""
    proc = tree.proc
    assert proc.stdout is not None and proc.stderr is not None
    out, err = bytearray(), bytearray()
    kept = {proc.stdout.fileno(): out, proc.stderr.fileno(): err}
    stopped = None
    with selectors.DefaultSelector() as sel:
        for fd in kept:
            os.set_blocking(fd, False)
            sel.register(fd, selectors.EVENT_READ)
        sel.register(tree.info_fd, selectors.EVENT_READ)
        while (set(sel.get_map()) & set(kept)) and stopped is None:
            left = clock.end() - time.monotonic()
            if left <= 0:
                stopped = clock.bound()
                break
            for key, _ in sel.select(timeout=left):
                if key.fd == tree.info_fd:
                    done = tree.read_info()
                    if done:
                        sel.unregister(key.fd)
                    if clock.started is None and (tree.pid is not None or done):
                        clock.started = time.monotonic()  # the program's process exists (or never will)
                    continue
                try:
                    chunk = os.read(key.fd, 2**16)
                except BlockingIOError:
                    continue
                if not chunk:
                    sel.unregister(key.fd)
                    continue
                buf = kept[key.fd]
                room = limits.output_bytes - len(buf)
                buf += chunk[:room]
                if len(chunk) > room:
                    stopped = "output"
                    break
    if stopped is not None:
        tree.kill()
    proc.stdout.close()
    proc.stderr.close()
    return bytes(out), bytes(err), stopped


def _wait(proc: subprocess.Popen, deadline: float | None) -> int | None:
    """Reap the outer process: its exit code, or None when the deadline passed first."""
    try:
        return proc.wait(timeout=None if deadline is None else max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        return None


def _classify(limits: SandboxConfig, stopped: str | None, code: int | None, stderr: bytes,
              group: cgroups.ExecutionGroup | None, deadline: Deadline | None = None) -> tuple[str, str | None]:
    """`stopped`: what ended it early ('output', 'wall', 'setup', 'deadline'), or None."""
    if stopped == "output":
        return "output", f"output passed rollout.sandbox.output_bytes={limits.output_bytes} bytes"
    memory = f"memory limit rollout.sandbox.memory_mb={limits.memory_mb} MiB reached"
    oom = group is not None and group.memory_hit()
    if stopped == "setup":
        return "timeout", f"the sandbox did not start the program within {SETUP_S:g} s (an overloaded host)"
    if stopped in ("wall", "deadline"):
        wall = (f"the {deadline.what} ran out" if stopped == "deadline" and deadline is not None
                else f"wall-clock limit rollout.sandbox.wall_s={limits.wall_s} s reached")
        # A tree at its memory limit can stall in the kernel's reclaim past the wall limit (seen once
        # in a suite run on a loaded machine): the memory limit is what stopped it.
        if oom:
            return "memory", f"{memory}, then {wall if stopped == 'deadline' else 'the ' + wall}"
        return "timeout", wall
    if code == 0:  # a child may have been killed at the limit; the program itself succeeded
        return "ok", f"{memory} (a process was killed)" if oom else None
    if oom or stderr.decode("utf-8", "replace").strip().rsplit("\n", 1)[-1].startswith("MemoryError"):
        return "memory", memory
    if code in (128 + signal.SIGXCPU, 128 + signal.SIGKILL):  # RLIMIT_CPU's signals (not the OOM killer: above)
        return "timeout", f"CPU time limit rollout.sandbox.cpu_s={limits.cpu_s} s reached"
    if group is not None and group.pids_hit():
        return "processes", f"process limit rollout.sandbox.processes={limits.processes} reached"
    return "error", None

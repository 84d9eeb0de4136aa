"""cgroup v1 `memory` and `pids` groups for one execution: a hard limit on the whole tree's memory
and process count, counters that say which limit was hit, and a sweep that kills what is left;
a `cpuacct` group too where mounted, for the tree's CPU time.

Used where /sys/fs/cgroup/memory and /sys/fs/cgroup/pids are writable cgroup v1 hierarchies (as
root on these machines); elsewhere the sandbox relies on rlimits and the PID namespace alone."""

from __future__ import annotations

import contextlib
import itertools
import os
import signal
import time
from pathlib import Path

ROOT = Path("/sys/fs/cgroup")
PARENT = "tandem-sandbox"
_serial = itertools.count()


def available() -> bool:
    """True when this process can make memory and pids groups (cgroup v1, root)."""
    if os.geteuid() != 0:
        return False
    for controller, probe in (("memory", "memory.limit_in_bytes"), ("pids", "cgroup.procs")):
        base = ROOT / controller
        if not (base / probe).is_file() or not os.access(base, os.W_OK):
            return False
    return True


_swept = False


def remove_stale() -> None:
    """Remove the groups of processes that died in mid-execution (killed, their cleanup never
    ran); once per process, on its first execution. Their sandboxes died with them (pdeathsig)."""
    global _swept
    if _swept:
        return
    _swept = True
    for group in ROOT.glob(f"*/{PARENT}/*-*-*"):
        owner = int(group.name.split("-")[0])
        try:
            os.kill(owner, 0)
        except ProcessLookupError:
            with contextlib.suppress(OSError):
                group.rmdir()
        except PermissionError:
            pass


class ExecutionGroup:
    """The memory and pids groups of one execution, made by `create` and removed by `remove`.

    `enter_script` is the shell line that moves the shell running it into both groups before it
    execs the sandbox, so that nothing the sandbox starts is ever outside them."""

    def __init__(self, uid: int, memory_bytes: int, max_pids: int):
        name = f"{os.getpid()}-{uid}-{next(_serial)}"
        self.dirs = [ROOT / "memory" / PARENT / name, ROOT / "pids" / PARENT / name]
        if (ROOT / "cpuacct" / "cpuacct.usage").is_file():
            self.dirs.append(ROOT / "cpuacct" / PARENT / name)
        self.memory_bytes, self.max_pids = memory_bytes, max_pids

    @property
    def memory(self) -> Path:
        return self.dirs[0]

    @property
    def pids(self) -> Path:
        return self.dirs[1]

    def create(self) -> None:
        remove_stale()
        for d in self.dirs:
            d.mkdir(parents=True, exist_ok=True)
        (self.memory / "memory.limit_in_bytes").write_text(str(self.memory_bytes))
        swap = self.memory / "memory.memsw.limit_in_bytes"
        if swap.exists():  # memory + swap: with swap on, the limit alone would let the tree swap
            swap.write_text(str(self.memory_bytes))
        (self.pids / "pids.max").write_text(str(self.max_pids))

    def enter_script(self) -> str:
        return " && ".join(f"echo $$ > {d / 'cgroup.procs'}" for d in self.dirs)

    def memory_hit(self) -> bool:
        """The kernel's OOM killer ran in the group (the tree used all its memory)."""
        text = _read(self.memory / "memory.oom_control")
        return any(line.split()[:1] == ["oom_kill"] and int(line.split()[1]) > 0 for line in text.splitlines())

    def pids_hit(self) -> bool:
        """A fork failed at the group's process limit."""
        text = _read(self.pids / "pids.events")
        return any(line.split()[:1] == ["max"] and int(line.split()[1]) > 0 for line in text.splitlines())

    def cpu_seconds(self) -> float | None:
        """CPU time of every process the group held (None without a cpuacct group)."""
        if len(self.dirs) < 3:
            return None
        text = _read(self.dirs[2] / "cpuacct.usage").strip()
        return int(text) / 1e9 if text else None

    def tasks(self) -> list[int]:
        return [int(p) for p in _read(self.pids / "cgroup.procs").split()]

    def count(self) -> int:
        """Processes charged to the group: living ones, and exited ones until they are reaped
        (cgroup.procs lists the living only)."""
        text = _read(self.pids / "pids.current").strip()
        return int(text) if text else 0

    def kill_all(self, timeout_s: float = 10.0) -> None:
        """SIGKILL every process in the group until none is charged to it (the namespace's init
        takes its tree with it; this catches anything it did not)."""
        deadline = time.monotonic() + timeout_s
        while self.count() and time.monotonic() < deadline:
            for pid in self.tasks():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.002)

    def remove(self) -> None:
        for d in self.dirs:
            for _ in range(200):  # a group is removable once its last task has been reaped
                try:
                    d.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.01)


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""

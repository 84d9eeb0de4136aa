"""Process bookkeeping for launch tests, from /proc (no psutil)."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import time
import uuid
from collections.abc import Iterable
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# Children import `tests.launch.helpers`; one thread each on this 2-core machine.
CHILD_ENV = {"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}


def _stat(pid: int) -> list[str] | None:
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    return text.rsplit(")", 1)[1].split()  # state, ppid, pgrp, session, ...


def alive(pid: int) -> bool:
    """Running (a zombie waiting for its parent to reap it counts as gone)."""
    st = _stat(pid)
    return st is not None and st[0] not in ("Z", "X")


def wait_gone(pids: set[int], timeout: float = 15) -> list[int]:
    """The processes of `pids` still alive after up to `timeout` seconds (a bounded wait)."""
    deadline = time.monotonic() + timeout
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    return [p for p in pids if alive(p)]


def all_pids() -> list[int]:
    return [int(d) for d in os.listdir("/proc") if d.isdigit()]


def descendants(root: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for pid in all_pids():
        st = _stat(pid)
        if st is not None:
            children.setdefault(int(st[1]), []).append(pid)
    out, todo = set(), [root]
    while todo:
        for c in children.get(todo.pop(), []):
            if c not in out:
                out.add(c)
                todo.append(c)
    return out


def in_groups(pgids: set[int]) -> list[int]:
    """Live processes whose process group is one of `pgids`."""
    found = []
    for pid in all_pids():
        st = _stat(pid)
        if st is not None and st[0] not in ("Z", "X") and int(st[2]) in pgids:
            found.append(pid)
    return found


def can_listen(port: int) -> bool:
    """True when nothing listens on 127.0.0.1:port any more (SO_REUSEADDR, as servers bind)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
            s.listen(1)
        except OSError:
            return False
    return True


def _socket_inodes(pid: int) -> set[str]:
    inodes = set()
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    except (FileNotFoundError, PermissionError):
        pass
    return inodes


def _decode_address(hex_addr: str) -> str:
    raw = bytes.fromhex(hex_addr)
    if len(raw) == 4:
        return socket.inet_ntop(socket.AF_INET, raw[::-1])
    words = b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4))  # /proc prints each 32-bit word in host order
    return socket.inet_ntop(socket.AF_INET6, words)


def listening_sockets(pids: set[int]) -> list[tuple[int, str, int]]:
    """(pid, local address, port) of every TCP socket in LISTEN state that one of `pids` holds,
    from /proc/net/tcp and tcp6."""
    owner = {inode: pid for pid in pids for inode in _socket_inodes(pid)}
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            next(f)
            for line in f:
                fields = line.split()
                local, state, inode = fields[1], fields[3], fields[9]
                if state == "0A" and inode in owner:  # 0A: LISTEN
                    addr, port = local.rsplit(":", 1)
                    found.append((owner[inode], _decode_address(addr), int(port, 16)))
    return found


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


MARK = "TANDEM_TEST_RUN"


def marked(value: str, var: str = MARK) -> list[int]:
    """Live processes whose environment holds `var=value`: everything started below a process
    given that variable inherits it, orphans (reparented to init) included."""
    needle = f"{var}={value}".encode()
    found = []
    for pid in all_pids():
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes()
        except OSError:
            continue
        if needle in env.split(b"\0") and alive(pid):
            found.append(pid)
    return found


SHM = Path("/dev/shm")


def shm_inodes(pids: Iterable[int]) -> set[int]:
    """Inodes of the /dev/shm files that `pids` map (from /proc/PID/maps), named or not: glibc
    builds a semaphore in a temporary file, maps it and only then links it to its name, so its
    creator maps it under the temporary name ("(deleted)")."""
    inodes = set()
    for pid in pids:
        try:
            maps = Path(f"/proc/{pid}/maps").read_text()
        except OSError:
            continue
        for line in maps.splitlines():
            parts = line.split(maxsplit=5)  # address perms offset dev inode path
            if len(parts) == 6 and parts[5].startswith(f"{SHM}/"):
                inodes.add(int(parts[4]))
    return inodes


def shm_names(inodes: set[int]) -> set[str]:
    """Names in /dev/shm of the files with these inodes."""
    names = set()
    for entry in os.scandir(SHM):
        with contextlib.suppress(FileNotFoundError):
            if entry.inode() in inodes:
                names.add(entry.name)
    return names


class Marked:
    """The processes of a process tree and its /dev/shm objects, found without guessing: start
    its root with `env` added to its environment (a fresh token every descendant inherits).
    Its objects are the files its processes were seen to map (POSIX semaphores `sem.*`, weight
    segments), and weight segments (`tandem-w-<creator pid>-...`) created by one of its processes."""

    def __init__(self) -> None:
        self.token = uuid.uuid4().hex
        self.env = {MARK: self.token}
        self.shm_before = set(os.listdir(SHM))
        self.pids: set[int] = set()
        self.inodes: set[int] = set()
        self.objects: set[str] = set()  # names seen

    def scan(self) -> list[int]:
        """Live processes of the tree now; remembers them and the /dev/shm objects they map."""
        pids = marked(self.token)
        self.pids.update(pids)
        self.inodes |= shm_inodes(pids)
        self.objects |= self.shm_left()
        return pids

    def shm_left(self) -> set[str]:
        """Its /dev/shm objects that still exist."""
        now = set(os.listdir(SHM))
        segments = {n for n in now - self.shm_before if n.startswith("tandem-w-")
                    and n.split("-")[2].isdigit() and int(n.split("-")[2]) in self.pids}
        return shm_names(self.inodes) | segments

    def wait_gone(self, timeout: float) -> tuple[list[int], set[str], float]:
        """Look at /proc and /dev/shm until nothing of the tree is left or `timeout` passed;
        -> (processes left, objects left, seconds taken)."""
        start = time.monotonic()
        while True:
            pids, objects = self.scan(), self.shm_left()
            took = time.monotonic() - start
            if (not pids and not objects) or took > timeout:
                return pids, objects, took
            time.sleep(0.02)

    def describe(self, pids: Iterable[int], objects: Iterable[str]) -> str:
        return "\n".join([*(f"  pid {p}: {cmdline(p)[:160]}" for p in pids), *(f"  {SHM}/{o}" for o in sorted(objects))])

    def clean_up(self) -> None:
        """Whatever a failed test left: SIGKILL the processes, unlink the objects."""
        for pid in self.scan():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        for name in self.shm_left():
            with contextlib.suppress(FileNotFoundError):
                (SHM / name).unlink()

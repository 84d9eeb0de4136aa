"""Process bookkeeping for launch tests, from /proc (no psutil)."""

from __future__ import annotations

import os
import socket
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

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

"""Uids for sandbox slots that no other sandbox on this host holds at the same time.

Per-uid limits (RLIMIT_NPROC) and the sweep of a slot's processes count everything of that uid, so
two pools must never share one: each reward worker process has its own pool, all from the same
`rollout.sandbox.uid_base`. A `UidLease` takes the lowest free uids from `uid_base` up, each held
by an exclusive `flock` on a lock file (LOCK_DIR/<uid>.lock) for the lease's life; the kernel drops
a dead process's locks, so a killed holder frees its uids. Without root no uid is changed: every
slot runs as the current user, and nothing is leased."""

from __future__ import annotations

import contextlib
import fcntl
import os
import tempfile
import threading
from pathlib import Path

from tandem.errors import SandboxUnavailable

SPAN = 2**16  # how far above uid_base a lease looks (config.py caps uid_base to leave this room)
_dir_lock = threading.Lock()


def lock_dir() -> Path:
    """Where the lock files are: /run/tandem-sandbox (root's), else one in the temporary directory."""
    for parent in (Path("/run"), Path(tempfile.gettempdir())):
        d = parent / "tandem-sandbox"
        with contextlib.suppress(OSError), _dir_lock:
            d.mkdir(mode=0o700, exist_ok=True)
            if os.access(d, os.W_OK):
                return d
    raise SandboxUnavailable("no writable directory for the sandbox's uid locks (/run/tandem-sandbox, or "
                             f"{tempfile.gettempdir()}/tandem-sandbox)")


class UidLease:
    """`count` uids from `base` up, held until `close()` (or the process's death). Not root: the
    current uid `count` times, nothing held."""

    def __init__(self, base: int, count: int):
        self._fds: list[int] = []
        if os.geteuid() != 0:
            self.uids = [os.getuid()] * count
            return
        self.uids = []
        folder = lock_dir()
        try:
            for uid in range(base, base + SPAN):
                if len(self.uids) == count:
                    break
                fd = os.open(folder / f"{uid}.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # per open file: also excludes this process's other leases
                except BlockingIOError:
                    os.close(fd)
                    continue
                self._fds.append(fd)
                self.uids.append(uid)
            if len(self.uids) < count:
                raise SandboxUnavailable(f"rollout.sandbox.uid_base: fewer than {count} free uids in "
                                         f"[{base}, {base + SPAN}); other sandboxes hold the rest")
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        for fd in self._fds:
            os.close(fd)  # drops the flock
        self._fds = []

    def __enter__(self) -> UidLease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

"""Children die with their controller, even when it is SIGKILLed and cannot tear them down.

    python -m tandem.launch.guard PARENT_PID -- CMD [ARG ...]

asks Linux to send SIGKILL to this process when its parent dies (`PR_SET_PDEATHSIG`, which
survives `exec`), checks that the parent is still `PARENT_PID` (it may have died already), then
replaces itself with CMD. Workers call `die_with_parent` directly instead.

Caveat (Linux semantics): the signal fires when the *thread* that started the child ends, so a
scheduler should start children from a long-lived thread (normally the main thread).
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1


def die_with_parent(parent_pid: int, sig: int = signal.SIGKILL) -> bool:
    """Arrange for `sig` when the parent dies; exit at once if `parent_pid` is already gone.
    Returns False where the platform has no such mechanism (non-Linux)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
            return False
    except (OSError, AttributeError):
        return False
    if os.getppid() != parent_pid:
        os._exit(1)  # the parent died before the request took effect
    return True


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) < 3 or argv[1] != "--":
        sys.exit("usage: python -m tandem.launch.guard PARENT_PID -- CMD [ARG ...]")
    die_with_parent(int(argv[0]))
    cmd = argv[2:]
    os.execvp(cmd[0], cmd)


if __name__ == "__main__":
    main()

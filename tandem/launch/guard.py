"""Children die with their controller, even when it is SIGKILLed and cannot tear them down.

    python -m tandem.launch.guard PARENT_PID -- CMD [ARG ...]

arms `PR_SET_PDEATHSIG` (SIGKILL; survives `exec`), checks the parent is still `PARENT_PID`, then
execs CMD. Workers call `die_with_parent` instead, `multiprocessing` children `die_with_creator`.
Linux fires the signal when the *thread* that started the child ends: start children from a
long-lived thread (normally the main one). See docs/launch.md, "Nothing outlives the controller"."""

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


def die_with_creator(creator_pid: int) -> bool:
    """In a process started by `multiprocessing` with the spawn or forkserver method (first thing,
    e.g. as a pool's initializer): die when `creator_pid`, the process that started it, dies; exit
    at once if it is gone already. Returns False where the platform has no parent-death signal.

    spawn: the creator is the parent (`die_with_parent`). forkserver: the parent is the fork
    server, which exits by itself once its "alive" pipe reports EOF, i.e. once every holder of the
    pipe's write end is gone: the creator, and every process the server forked (each inherits
    it). This process arms the signal against the server, which cannot have exited yet since this
    process still holds the pipe, then drops its copy; from then on the server lives as long as
    the creator, and this process as long as the server."""
    from multiprocessing import forkserver

    if forkserver.get_inherited_fds() is None:  # not started by a fork server
        return die_with_parent(creator_pid)
    if not die_with_parent(os.getppid()):
        return False
    server = forkserver._forkserver  # the module's singleton: the pipe's end this process holds
    if server._forkserver_alive_fd is not None:
        os.close(server._forkserver_alive_fd)
        server._forkserver_alive_fd = None  # a fork server this process asks for is its own, new one
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

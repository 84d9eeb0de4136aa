"""The command line that starts one program isolated: cgroups entered, rlimits set, privileges
dropped to the slot's leased uid, then bubblewrap with every namespace unshared and a read-only /usr.

    sh -c 'enter cgroups && exec "$@"'   (root with cgroup v1 only)
      prlimit --cpu --as --nproc --fsize --nofile --core --
        setpriv --pdeathsig KILL [--reuid U --regid U --clear-groups --inh-caps=-all --bounding-set=-all (root)]
          bwrap --unshare-all ... /usr/bin/python3 -I -S /tmp/main.py
"""

from __future__ import annotations

import math
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from tandem.errors import SandboxUnavailable
from tandem.sandbox.config import SandboxConfig

PYTHON = "/usr/bin/python3"  # the system's interpreter: its files are all under /usr
WORKDIR = "/tmp"  # inside the sandbox: a private tmpfs, the program's cwd and HOME
MAIN = f"{WORKDIR}/main.py"
SANDBOX_PATH = "/usr/bin:/bin"
HOST_PATH = "/usr/sbin:/usr/bin:/sbin:/bin"  # where the tools are looked up; the run's PATH is not used
OPEN_FILES = 64
# Processes of the sandbox that are not the program: the outer bwrap (the program is the namespace's init).
OVERHEAD_PROCESSES = 1
MERGED_USR = ("bin", "sbin", "lib", "lib32", "lib64", "libx32")


@dataclass(frozen=True)
class Tools:
    """Absolute paths of the programs the command line runs."""

    bwrap: str
    prlimit: str
    setpriv: str


def find_tools(config: SandboxConfig) -> Tools:
    """The tools' paths; SandboxUnavailable naming what is missing and how to get it."""
    bwrap = shutil.which(config.bwrap, path=HOST_PATH) or (config.bwrap if os.access(config.bwrap, os.X_OK) else None)
    if bwrap is None:
        raise SandboxUnavailable(
            f"rollout.sandbox.bwrap: bubblewrap {config.bwrap!r} was not found; install it (`apt-get install "
            f"bubblewrap`, or `make test-deps`) or set rollout.sandbox.bwrap to its path")
    prlimit = shutil.which("prlimit", path=HOST_PATH)
    setpriv = shutil.which("setpriv", path=HOST_PATH)
    if prlimit is None or setpriv is None:
        raise SandboxUnavailable("prlimit and setpriv (Debian's util-linux) are needed to set the sandbox's "
                                 "limits and drop root; install util-linux")
    if not os.access(PYTHON, os.X_OK):
        raise SandboxUnavailable(f"{PYTHON} is missing: the sandbox runs programs with the system's Python "
                                 f"(`apt-get install python3`)")
    return Tools(bwrap, prlimit, setpriv)


def rlimits(config: SandboxConfig, uid: int, cgroup_pids: bool) -> list[str]:
    """prlimit's options. RLIMIT_CPU is whole seconds (cpu_s rounded up), soft and hard alike: the
    program is its namespace's init, which ignores SIGXCPU, so the hard limit's SIGKILL stops it.
    RLIMIT_NPROC counts every process of the uid; with a pids
    cgroup it is set well above the cgroup's limit, so that the cgroup (which reports it) binds
    first, also while exited processes are not yet released (both count those)."""
    cpu = max(1, math.ceil(config.cpu_s))
    nproc = config.processes + OVERHEAD_PROCESSES
    if cgroup_pids:
        nproc = 2 * nproc + 16
    if os.geteuid() != 0:  # the user's other processes count against the limit too
        nproc += len(uid_processes(uid))
    memory = config.memory_mb * 2**20
    return [f"--cpu={cpu}", f"--as={memory}", f"--nproc={nproc}", f"--fsize={config.file_bytes}",
            f"--nofile={OPEN_FILES}", "--core=0"]


def bwrap_arguments(config: SandboxConfig, program_fd: int, info_fd: int) -> list[str]:
    """bubblewrap's options and the program: all namespaces new, /usr read-only, nothing else of
    the host (no /etc, /home, /root, /work, host /tmp), a private tmpfs as cwd holding the
    program, a cleared environment, the rest of the tree read-only.

    The program is pid 1 of its namespace (`--as-pid-1`): with bwrap's own init in between, the
    outer bwrap exits as soon as the program does without reaping that init, which then stays a
    zombie until the host's pid 1 reaps it (never, in a container whose pid 1 does not). As init,
    the program's exit kills everything else in the namespace. bwrap writes the program's host
    pid to `info_fd` (JSON, `child-pid`), so that the parent can kill it first and let the outer
    bwrap reap it."""
    links: list[str] = []
    for name in MERGED_USR:
        host = Path("/") / name
        if host.is_symlink():
            links += ["--symlink", os.readlink(host), f"/{name}"]
        elif host.is_dir():
            links += ["--ro-bind", str(host), f"/{name}"]
    return [
        "--info-fd", str(info_fd), "--unshare-all", "--unshare-user", "--disable-userns", "--die-with-parent", "--new-session",
        "--hostname", "sandbox",
        "--ro-bind", "/usr", "/usr", *links,
        "--proc", "/proc", "--dev", "/dev",
        "--size", str(config.memory_mb * 2**20), "--tmpfs", WORKDIR,
        "--file", str(program_fd), MAIN, "--chdir", WORKDIR,
        "--clearenv", "--setenv", "PATH", SANDBOX_PATH, "--setenv", "HOME", WORKDIR, "--setenv", "LANG", "C.UTF-8",
        "--setenv", "MALLOC_ARENA_MAX", "2",
        "--remount-ro", "/dev", "--remount-ro", "/",
        "--as-pid-1", "--", PYTHON, "-I", "-S", MAIN,
    ]


def command(config: SandboxConfig, tools: Tools, uid: int, program_fd: int, info_fd: int,
            enter_cgroups: str | None) -> list[str]:
    """The whole command line of one execution as `uid` (see the module's docstring; a leased uid,
    `tandem.sandbox.uids`, or the current one without root)."""
    argv = [tools.prlimit, *rlimits(config, uid, enter_cgroups is not None), "--"]
    # Tandem's death kills the outer bwrap (bwrap's --die-with-parent sets the same for itself;
    # this one holds regardless) and so the program; setpriv sets it after the uid change, which
    # would clear it. Not root: no uid change, bwrap starts as the current user.
    argv += [tools.setpriv, "--pdeathsig", "KILL"]
    if os.geteuid() == 0:
        argv += [f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--inh-caps=-all", "--bounding-set=-all"]
    argv += [tools.bwrap, *bwrap_arguments(config, program_fd, info_fd)]
    if enter_cgroups is not None:
        argv = ["/bin/sh", "-c", f'{enter_cgroups} && exec "$@"', "sh", *argv]
    return argv


def real_uid(pid: int) -> int | None:
    """The real uid of process `pid` (None when it is gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("Uid:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def uid_processes(uid: int) -> list[int]:
    """Pids of the host's processes whose real uid is `uid` (from /proc)."""
    return [int(e.name) for e in os.scandir("/proc") if e.name.isdigit() and real_uid(int(e.name)) == uid]

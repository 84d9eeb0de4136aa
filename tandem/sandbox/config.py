"""`rollout.sandbox`: the limits of one execution of untrusted code, and the pool's size."""

from __future__ import annotations

from dataclasses import dataclass

from tandem.config.fields import config_field as _f


@dataclass
class SandboxConfig:
    """Limits of one sandboxed execution (docs/security.md). Every limit, when reached, stops the
    whole process tree of the execution and is named in its `reason`."""

    workers: int = _f(2, "Sandboxed executions that run at once in one pool (its slots, each with its own uid); "
                         "each reward worker process has its own pool.", min=1, max=256)
    cpu_s: float = _f(5.0, "CPU seconds of each process of one execution (RLIMIT_CPU, rounded up to whole "
                           "seconds); past it the process is killed (status timeout).", gt=0.0)
    wall_s: float = _f(10.0, "Wall-clock seconds of one execution; past it the process tree is killed "
                             "(status timeout).", gt=0.0)
    memory_mb: int = _f(256, "Memory of one execution in MiB: each process's address space (RLIMIT_AS) and, "
                             "where cgroup v1 is mounted, the whole tree's memory (status memory).", min=32)
    processes: int = _f(16, "Processes and threads one execution may run at once (the cgroup pids limit, "
                            "RLIMIT_NPROC); a fork past it fails (status processes).", min=1)
    output_bytes: int = _f(65536, "Bytes kept of stdout and of stderr each; an execution that writes more is "
                                  "killed (status output).", min=1)
    file_bytes: int = _f(16 * 2**20, "Largest file an execution may write (RLIMIT_FSIZE), and the largest "
                                     "program or stdin it accepts (larger: status refused).", min=1)
    uid_base: int = _f(200000, "When Tandem runs as root, each slot runs as its own uid and gid, the lowest "
                               "free from uid_base up (pools lease them: two never share one); keep the 65536 "
                               "uids from here unused on this host.", min=1000, max=2**31 - 2**16)
    bwrap: str = _f("bwrap", "The bubblewrap binary (a path, or a name looked up on PATH); without it the "
                             "sandbox refuses to run (make test-deps installs it).")


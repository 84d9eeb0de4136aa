"""CPU pinning of launched processes: `TANDEM_CPUS=0-1,4` restricts a process to those cores.

The launcher sets it per role (`actor.cpus`, `rollout.cpus`), so servers and trainers can be kept
on separate cores (no time slicing between generation and training); every entry point (the
`tandem` command, the trainer worker) applies it before doing any work.
"""

from __future__ import annotations

import contextlib
import os
import re

ENV_CPUS = "TANDEM_CPUS"


def parse_cpus(spec: str) -> set[int]:
    """'0-2,5' -> {0, 1, 2, 5}; ValueError naming the spec when it is malformed."""
    cpus: set[int] = set()
    for part in (p.strip() for p in spec.split(",")):
        match = re.fullmatch(r"(\d+)(?:-(\d+))?", part)
        if match is None:
            raise ValueError(f"CPU list {spec!r} must look like '0-3,6' (cores and ranges)")
        lo, hi = int(match[1]), int(match[2] or match[1])
        cpus.update(range(lo, hi + 1))
    if not cpus:
        raise ValueError(f"CPU list {spec!r} names no core")
    return cpus


def apply_cpu_affinity_from_env() -> set[int] | None:
    """Pin this process to the cores in `TANDEM_CPUS`, if set; returns them."""
    spec = os.environ.get(ENV_CPUS)
    if not spec:
        return None
    cpus = parse_cpus(spec)
    # sched_setaffinity(0) pins only the calling thread; threads that imports already started
    # (e.g. a library's pool) keep the old mask, so pin every thread of the process.
    for tid in _thread_ids():
        with contextlib.suppress(ProcessLookupError):  # the thread ended meanwhile
            os.sched_setaffinity(tid, cpus)
    return cpus


def _thread_ids() -> list[int]:
    try:
        return [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:  # no /proc: the calling thread only
        return [0]

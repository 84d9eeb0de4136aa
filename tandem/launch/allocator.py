"""The memory allocator of `tandem serve`: tcmalloc when the machine has it, else glibc's malloc.

glibc returns large blocks to the kernel on free, so every step of a big batch faults its
activations in again (first-touch pages cost ~0.4 GB/s in the VMs measured); tcmalloc keeps and
reuses them (medium preset, in process: prefill 1.73 -> 1.30 s, the whole serve bench 2,591 ->
2,875 tok/s). vLLM's CPU build preloads tcmalloc the same way. An allocator must be loaded before
the process starts, so `tandem serve` re-executes itself once with `LD_PRELOAD` set
(`reexec_with_allocator`); the PID stays. No tcmalloc on the machine is a logged fallback, never
an error (`make test-deps` installs Debian's libtcmalloc-minimal4)."""

from __future__ import annotations

import ctypes.util
import logging
import os
import sys
from pathlib import Path

logger = logging.getLogger(__name__)

CHOICES = ("tcmalloc", "system")
LIBRARY = "tcmalloc_minimal"  # the soname libtcmalloc_minimal.so.4: no heap profiler, nothing else loaded
ENV_GUARD = "TANDEM_ALLOCATOR_REEXEC"  # set across the re-exec: never loop


def loaded(name: str = LIBRARY, maps: Path = Path("/proc/self/maps")) -> bool:
    """Whether a library whose file name starts with lib`name` is mapped into this process."""
    try:
        text = maps.read_text()
    except OSError:
        return False
    return f"/lib{name}" in text


def find(name: str = LIBRARY) -> str | None:
    """The library's soname as the dynamic loader knows it (`ldconfig`), or None."""
    return ctypes.util.find_library(name)


def reexec_with_allocator(choice: str) -> None:
    """`choice` "tcmalloc": unless already loaded, re-execute this command with it preloaded (does
    not return); if the machine has none, log the fallback and return. "system": return."""
    if choice not in CHOICES:
        raise ValueError(f"--allocator {choice!r}: choose one of {', '.join(CHOICES)}")
    if choice == "system" or loaded():
        return
    if os.environ.get(ENV_GUARD):
        logger.warning("tcmalloc was preloaded but is not mapped into this process; running on glibc's malloc")
        return
    library = find()
    if library is None:
        logger.warning("tcmalloc is not installed (Debian: apt-get install libtcmalloc-minimal4, or make test-deps): "
                       "running on glibc's malloc, which is slower for large batches; --allocator system "
                       "silences this")
        return
    env = dict(os.environ)
    env["LD_PRELOAD"] = ":".join(p for p in (library, env.get("LD_PRELOAD", "")) if p)
    env[ENV_GUARD] = "1"
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)

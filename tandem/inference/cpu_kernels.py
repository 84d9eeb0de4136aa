"""Tandem's CPU kernels (C++ in `csrc/`), built for this machine on first use and cached.

`paged_attention()`, `rms_norm()` and `sampler()` -> an extension module, or None where it cannot be had: not asked for
(`TANDEM_CPU_KERNELS=0`), no compiler or ninja, or a failed build. None is a logged fallback to
the pure-PyTorch path, never an error: the kernels change speed, not results beyond float
rounding. Builds go to `$TANDEM_KERNEL_CACHE` (default `~/.cache/tandem/kernels`) under a name
that includes the source's (with the shared headers in `csrc/`) and this CPU's fingerprints, so a changed source or another CPU model
sharing the directory gets its own build (`-march=native`). Concurrent first uses (a fleet of
servers starting together) wait on torch's build lock. See docs/inference.md, "CPU kernels".
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import time
from pathlib import Path
from types import ModuleType

logger = logging.getLogger(__name__)

CSRC = Path(__file__).with_name("csrc")
ENV_SWITCH = "TANDEM_CPU_KERNELS"
ENV_CACHE = "TANDEM_KERNEL_CACHE"
CFLAGS = ["-O3", "-march=native", "-fopenmp", "-DNDEBUG"]


def enabled() -> bool:
    return os.environ.get(ENV_SWITCH, "1").strip().lower() not in ("0", "false", "no", "off")


def _cpu_fingerprint() -> str:
    """The CPU's model and feature flags (what -march=native compiles for)."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    wanted = [line for line in info.splitlines() if line.startswith(("model name", "flags"))][:2]
    return "\n".join(wanted)


def _build_name(source: Path) -> str:
    import torch

    digest = hashlib.sha256()
    headers = [h.read_bytes() for h in sorted(CSRC.glob("*.h"))]
    for part in (source.read_bytes(), *headers, _cpu_fingerprint().encode(), torch.__version__.encode(),
                 " ".join(CFLAGS).encode()):
        digest.update(part)
    return f"tandem_{source.stem}_{digest.hexdigest()[:16]}"


def _cache_dir() -> Path:
    root = os.environ.get(ENV_CACHE) or Path.home() / ".cache" / "tandem" / "kernels"
    return Path(root)


@functools.cache
def paged_attention() -> ModuleType | None:
    """The paged decode attention kernel (`csrc/paged_attention.cpp`), or None (logged once)."""
    if not enabled():
        logger.info("CPU kernels are off (%s=0): decode attention runs in PyTorch", ENV_SWITCH)
        return None
    return _load(CSRC / "paged_attention.cpp", "paged attention")


@functools.cache
def rms_norm() -> ModuleType | None:
    """The one-pass RMSNorm (`csrc/rms_norm.cpp`), or None (logged once)."""
    if not enabled():
        return None
    return _load(CSRC / "rms_norm.cpp", "RMSNorm")


@functools.cache
def sampler() -> ModuleType | None:
    """The sampler's one-pass draw (`csrc/sampler.cpp`), or None (logged once)."""
    if not enabled():
        return None
    return _load(CSRC / "sampler.cpp", "sampler")


def _load(source: Path, what: str) -> ModuleType | None:
    name = _build_name(source)
    build = _cache_dir() / name
    built = build / f"{name}.so"
    started = time.monotonic()
    try:
        if built.exists() and not (build / "lock").exists():  # no build under way; the name fixes source,
            # flags, CPU and torch, so there is nothing to check: no ninja run
            return _import(name, built)
        from torch.utils import cpp_extension

        build.mkdir(parents=True, exist_ok=True)
        module = cpp_extension.load(name=name, sources=[str(source)], extra_cflags=CFLAGS,
                                    extra_ldflags=["-fopenmp"], build_directory=str(build), verbose=False)
    except Exception as exc:  # a compiler or ninja missing, a failed build: the PyTorch path serves
        reason = str(exc).strip().splitlines()[-1] if str(exc).strip() else ""
        logger.warning("the CPU %s kernel could not be built (%s: %s); it runs in PyTorch instead (slower). "
                       "Install g++ and ninja (`make test-deps` does) or set %s=0 to silence this",
                       what, type(exc).__name__, reason, ENV_SWITCH)
        return None
    logger.info("built the CPU %s kernel in %.1f s (%s)", what, time.monotonic() - started, build)
    return module


def _import(name: str, path: Path) -> ModuleType:
    import importlib.util

    import torch  # noqa: F401  (the extension links against torch's libraries: load them first)

    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def build_all() -> None:
    """`make kernels`: build (or find) every kernel and say where."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    for what, load in (("paged attention", paged_attention), ("RMSNorm", rms_norm), ("sampler", sampler)):
        built = load()
        print(f"CPU kernels: {what} {'ready: ' + str(built.__file__) if built else 'NOT built (see above)'}")

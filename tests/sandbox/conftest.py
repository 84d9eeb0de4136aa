"""The sandbox's tests run real bubblewrap on real processes. They skip only where bubblewrap
could not be installed (`make sandbox-deps` records why in .sandbox.failed); where it is installed
and isolation still fails, they fail.

Each test process uses its own uids (`UID_BASE`, from its pid, 64 of them), so that the two workers of
`make test -n 2` never see each other's sandboxes in /proc."""

from __future__ import annotations

import glob
import os
import shutil
from pathlib import Path

import pytest

from tandem.sandbox import SandboxConfig, SandboxPool

ROOT = Path(__file__).resolve().parents[2]
UID_BASE = 300000 + (os.getpid() % 4000) * 64  # room for the offsets test_session.py uses
WORKERS = 2


def bwrap_missing() -> str | None:
    if shutil.which("bwrap") is not None:
        return None
    failed = ROOT / ".sandbox.failed"
    return "bubblewrap is not installed (" + (failed.read_text().strip() if failed.exists()
                                              else "run `make sandbox-deps`") + ")"


def limits(**changes) -> SandboxConfig:
    """Tight limits, so that each hostile program meets them quickly."""
    base = dict(workers=WORKERS, cpu_s=1.0, wall_s=3.0, memory_mb=256, processes=16, output_bytes=4096,
                uid_base=UID_BASE)
    return SandboxConfig(**{**base, **changes})


def sandbox_processes(uids: range) -> list[tuple[int, int, str]]:
    """(pid, uid, command) of every host process whose real uid is in `uids`, read from /proc
    here rather than through the sandbox's own helpers."""
    found = []
    for status in glob.glob("/proc/[0-9]*/status"):
        try:
            text = Path(status).read_text()
            uid = int(next(line for line in text.splitlines() if line.startswith("Uid:")).split()[1])
            if uid in uids:
                cmd = Path(status).with_name("cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                found.append((int(Path(status).parent.name), uid, cmd))
        except (OSError, StopIteration):
            continue
    return found


def our_cgroups() -> list[str]:
    return glob.glob(f"/sys/fs/cgroup/*/tandem-sandbox/{os.getpid()}-*")


@pytest.fixture(scope="module")
def pool():
    if (why := bwrap_missing()) is not None:
        pytest.skip(why)
    with SandboxPool(limits()) as p:
        yield p


@pytest.fixture
def nothing_left(pool):
    """After the test: no process of the pool's uids, no cgroup of ours, and the pool still serves."""
    yield
    left = sandbox_processes(range(UID_BASE, UID_BASE + WORKERS))
    assert not left, f"processes left running as the sandbox's uids: {left}"
    assert not our_cgroups(), f"cgroups left: {our_cgroups()}"
    after = pool.run("print(6 * 7)")
    assert (after.status, after.stdout) == ("ok", "42\n"), after

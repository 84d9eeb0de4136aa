"""CPU pinning through TANDEM_CPUS, as a launched process sees it."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tandem.launch.affinity import ENV_CPUS, parse_cpus


def test_parse_cpus():
    assert parse_cpus("0-2,5") == {0, 1, 2, 5}
    assert parse_cpus("1") == {1}
    for bad in ("", "a", "1-", "0-x"):
        with pytest.raises(ValueError, match="CPU list"):
            parse_cpus(bad)


def test_child_is_pinned():
    core = min(os.sched_getaffinity(0))
    code = "from tandem.launch.affinity import apply_cpu_affinity_from_env as a; a(); import os; print(sorted(os.sched_getaffinity(0)))"
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, ENV_CPUS: str(core)},
                         capture_output=True, text=True, timeout=60, check=True).stdout
    assert out.strip() == f"[{core}]"


def test_threads_started_before_pinning_are_pinned_too():
    core = min(os.sched_getaffinity(0))
    code = (
        "import threading, time, os\n"
        "ev = threading.Event()\n"
        "t = threading.Thread(target=ev.wait); t.start()\n"
        "from tandem.launch.affinity import apply_cpu_affinity_from_env as a; a()\n"
        "print(sorted(os.sched_getaffinity(t.native_id))); ev.set(); t.join()\n"
    )
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, ENV_CPUS: str(core)},
                         capture_output=True, text=True, timeout=60, check=True).stdout
    assert out.strip() == f"[{core}]"

"""Stopping a `tandem` command a benchmark started in its own process group."""

from __future__ import annotations

import os
import signal
import subprocess


def stop_tandem(proc: subprocess.Popen, grace_s: float = 60.0) -> None:
    """Ctrl-C to the process group (tandem tears its servers and ranks down on it), then SIGKILL
    after `grace_s`; returns once the process has exited."""
    os.killpg(proc.pid, signal.SIGINT)
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()

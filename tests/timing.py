"""Time bounds that hold on a loaded machine: measured against a baseline taken in the same test,
so that a second test run beside this one (or a busy CI host) slows both sides alike."""

from __future__ import annotations

import subprocess
import sys
import time


def torch_import_s() -> float:
    """Wall seconds a fresh interpreter takes now to import torch: what every `tandem` command that
    gets as far as reading a config pays before it can refuse it."""
    start = time.monotonic()
    subprocess.run([sys.executable, "-c", "import torch"], check=True, capture_output=True, timeout=300)
    return time.monotonic() - start


def refusal_bound_s() -> float:
    """How long a command that refuses its input before launching anything may take: twice the
    interpreter's start-up now, plus 3 s. Launching even one process (a model load, a server) before
    refusing costs more than that on a quiet machine and a loaded one alike."""
    return 2 * torch_import_s() + 3.0

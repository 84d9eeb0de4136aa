"""`tandem.launch.guard`: importing it is cheap."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.launch.procs import CHILD_ENV, REPO

pytestmark = pytest.mark.timeout(120)


def test_the_guard_does_not_import_torch():
    """Every server's exec wrapper imports the guard: `tandem.launch` loads its modules on first
    use, so that costs no torch import (~1.2 s CPU)."""
    out = subprocess.run([sys.executable, "-c", "import json, sys, tandem.launch.guard; print(json.dumps(list(sys.modules)))"],
                         cwd=REPO, env={**os.environ, **CHILD_ENV}, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    modules = json.loads(out.stdout)
    assert "torch" not in modules and "tandem.launch.rpc" not in modules

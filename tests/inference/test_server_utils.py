"""The test helper's servers die with the test process, as the product's die with their controller."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.launch.procs import CHILD_ENV, REPO, alive, wait_gone

OWNER = """
import sys
from pathlib import Path
from tests.inference.server_utils import ServerProcess
server = ServerProcess(Path(sys.argv[1]), Path(sys.argv[2]), wait=False)
print(server.pid, flush=True)
sys.stdin.read()  # until killed
"""


def test_a_sigkilled_test_process_takes_its_server_along(qwen3_dir, tmp_path):
    """Catches `ServerProcess` starting `tandem serve` without `tandem.launch.guard`: a pytest worker
    killed by a timeout or a Ctrl-C then leaves its module's servers running (one was found 28 min
    after its worker died)."""
    owner = subprocess.Popen([sys.executable, "-c", OWNER, str(qwen3_dir), str(tmp_path)], cwd=REPO,
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                             env={**os.environ, **CHILD_ENV})
    try:
        server_pid = int(owner.stdout.readline())
        assert alive(server_pid)
    finally:
        owner.kill()
        owner.wait()
    left = wait_gone({server_pid}, timeout=30)
    assert not left, f"the server (pid {server_pid}) outlived the SIGKILLed process that started it"

"""Binding: a server reachable from other machines without an API key says so on stderr at startup
(the bind to 0.0.0.0 is real; traffic goes to 127.0.0.1 only)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tandem.net import is_loopback
from tests.inference.server_utils import LISTENING, request, wait_for

WARNING = "tandem serve: warning: listening on 0.0.0.0 (not a loopback address) without --api-key"


@pytest.mark.parametrize("host, loopback", [("127.0.0.1", True), ("127.8.9.10", True), ("::1", True),
                                            ("[::1]", True), ("localhost", True), ("0.0.0.0", False), ("::", False),
                                            ("192.168.1.7", False), ("fe80::1", False), ("myhost.example", False)])
def test_is_loopback(host, loopback):
    assert is_loopback(host) is loopback


@pytest.mark.parametrize("args, warns", [(("--host", "0.0.0.0"), True), (("--host", "127.0.0.1"), False),
                                         (("--host", "0.0.0.0", "--api-key", "k"), False)],
                         ids=["any-no-key", "loopback", "any-with-key"])
def test_a_non_loopback_bind_without_a_key_warns_on_stderr(qwen3_dir, tmp_path, args, warns):
    out, err = tmp_path / "stdout", tmp_path / "stderr"
    with out.open("w") as o, err.open("w") as e:
        proc = subprocess.Popen([sys.executable, "-m", "tandem.cli", "serve", "--model", str(qwen3_dir), "--port", "0",
                                 "--num-threads", "1", *args], stdout=o, stderr=e)
    try:
        port = int(wait_for(lambda: LISTENING.search(out.read_text()), timeout=60).group(1).rsplit(":", 1)[1])
        if warns:  # the warning is all: the server serves as usual (asked through loopback only)
            assert wait_for(lambda: request(f"http://127.0.0.1:{port}", "GET", "/health")[0] == 200, timeout=60)
    finally:
        proc.kill()  # what it printed at startup is all this test needs
        proc.wait(30)
    stderr = err.read_text()
    assert (WARNING in stderr) is warns, stderr
    assert WARNING not in out.read_text()  # stdout stays machine-readable
    if warns:
        for what in ("generate", "swap the served weights", "--api-key KEY", "--host 127.0.0.1"):
            assert what in stderr, (what, stderr)

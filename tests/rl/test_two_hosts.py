"""Two hosts on one machine (issue 24): two network namespaces made by the test, joined by a veth
pair with addresses the test picks. A `tandem serve` runs in one, `tandem train` in the other with
`cluster.host_ip` set to its own address, and the trainer's weights reach the server over a
distributed (gloo) weight group across the pair. No traffic leaves the two namespaces (each has
only its loopback and its end of the pair)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
import uuid

import pytest

from tests.launch.procs import CHILD_ENV
from tests.rl.common import TANDEM, rl_rows, write_config

PY = os.path.join(os.path.dirname(TANDEM), "python")


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


@pytest.fixture
def two_hosts():
    """(namespace A, address A, namespace B, address B), removed afterwards."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        why = "network namespaces need root and iproute2's `ip`"
        print(f"two-host test skipped: {why}")
        pytest.skip(why)
    tag = uuid.uuid4().hex[:6]
    a, b = f"tdm-a-{tag}", f"tdm-b-{tag}"
    octet = int(tag[:2], 16) % 250 + 1
    addr_a, addr_b = f"10.213.{octet}.1", f"10.213.{octet}.2"
    _ip("netns", "add", a)
    _ip("netns", "add", b)
    try:
        _ip("link", "add", f"va{tag}", "type", "veth", "peer", "name", f"vb{tag}")
        _ip("link", "set", f"va{tag}", "netns", a)
        _ip("link", "set", f"vb{tag}", "netns", b)
        for ns, dev, addr in ((a, f"va{tag}", addr_a), (b, f"vb{tag}", addr_b)):
            _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
            _ip("-n", ns, "link", "set", dev, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
        yield a, addr_a, b, addr_b
    finally:
        for ns in (a, b):  # deleting a namespace deletes its end of the pair, and so the pair
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)


def _in(ns: str, *cmd: str) -> list[str]:
    return ["ip", "netns", "exec", ns, *cmd]


def _get(ns: str, url: str, key: str) -> dict:
    code = (f"import json, urllib.request; r = urllib.request.Request({url!r}, headers={{'Authorization': "
            f"'Bearer {key}'}}); print(urllib.request.urlopen(r, timeout=10).read().decode())")
    out = subprocess.run(_in(ns, PY, "-c", code), capture_output=True, text=True, timeout=30, check=True)
    return json.loads(out.stdout)


def test_train_across_two_hosts_with_distributed_sync(two_hosts, model_dir, tmp_path):
    ns_a, addr_a, ns_b, addr_b = two_hosts
    key = uuid.uuid4().hex
    port = 31000 + int(uuid.uuid4().int % 1000)
    log = (tmp_path / "serve.log").open("w")
    server = subprocess.Popen(_in(ns_a, TANDEM, "serve", "--model-path", str(model_dir), "--host", addr_a, "--port",
                                  str(port), "--api-key", key, "--num-threads", "1"),
                              stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://{addr_a}:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert server.poll() is None, (tmp_path / "serve.log").read_text()
            try:
                _get(ns_b, f"{url}/get_weight_version", key)  # from the other host, over the pair
                break
            except subprocess.CalledProcessError:
                assert time.monotonic() < deadline, "the server never answered from the other namespace"
                time.sleep(0.5)
        cfg = write_config(tmp_path, model_dir, actor={"backend": "archon:d1"},
                           rollout={"backend": "tandem:d1", "servers": [url], "api_key": key},
                           train={"total_steps": 3, "weight_sync": "distributed"},
                           cluster={"host_ip": addr_b})
        proc = subprocess.run(_in(ns_b, TANDEM, "train", str(cfg)), capture_output=True, text=True, timeout=480,
                              env={**os.environ, **CHILD_ENV}, start_new_session=True)
        assert proc.returncode == 0, proc.stderr[-4000:]
        assert [r["step"] for r in rl_rows(tmp_path)] == [1, 2, 3]
        assert all(r["sync/servers"] == 1.0 for r in rl_rows(tmp_path))
        assert _get(ns_a, f"{url}/get_weight_version", key) == {"weight_version": "3"}
    finally:
        server.terminate()
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()
        log.close()

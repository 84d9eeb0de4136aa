"""Listeners of a run bind the address they are given (127.0.0.1 here), never every interface:
torch's own TCPStore server listens on 0.0.0.0 / :: whatever host it is handed."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tandem.net import bound_tcp_store
from tandem.weights.group import host_store
from tests.launch.procs import CHILD_ENV, listening_sockets


def _listeners_on(port: int) -> list[str]:
    return [addr for _, addr, p in listening_sockets({os.getpid()}) if p == port]


def test_bound_store_listens_on_loopback_only():
    store = bound_tcp_store("127.0.0.1", 0)
    assert _listeners_on(store.port) == ["127.0.0.1"]


def test_weight_group_store_listens_on_loopback_only():
    store = host_store("127.0.0.1", 0)
    assert _listeners_on(store.port) == ["127.0.0.1"]


def test_trainer_rendezvous_store_listens_on_master_addr_only():
    """Rank 0 of a trainer group (as `tandem.train.worker` starts it) hosts the default group's
    store on MASTER_ADDR; gloo's own sockets follow GLOO_SOCKET_IFNAME=lo (set by the launcher)."""
    code = (
        "import json, os, torch.distributed as dist\n"
        "from datetime import timedelta\n"
        "from tandem.train.dist import init_from_env\n"
        "from tests.launch.procs import listening_sockets\n"
        "init_from_env('gloo', timedelta(seconds=30))\n"
        "print(json.dumps(listening_sockets({os.getpid()})))\n"
        "dist.destroy_process_group()\n"
    )
    from tandem.launch.process import free_port

    env = {**os.environ, **CHILD_ENV, "RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(free_port()), "GLOO_SOCKET_IFNAME": "lo"}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    listeners = json.loads(proc.stdout.strip().splitlines()[-1])
    print(f"listeners of a 1-rank group: {listeners}")
    assert listeners and all(addr == "127.0.0.1" for _, addr, _ in listeners), listeners

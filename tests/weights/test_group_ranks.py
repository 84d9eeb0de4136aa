"""A distributed update to a fleet whose servers span 1, 2 and 4 devices: the broadcast transport
forms ONE group of 1 + 7 ranks over real HTTP and gloo, and every device of every server receives
every tensor bit for bit. The servers are stand-ins that speak SGLang's weight routes and place
their workers as SGLang's `ModelRunner.init_weights_update_group` does (`rank_offset + tp_rank`),
each worker a thread with its own group member (the trainer cannot tell them from processes)."""

from __future__ import annotations

import json
import threading
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
import torch

from tandem.fleet.adapters import SGLangAdapter
from tandem.fleet.http import HttpFleet
from tandem.weights.group import WeightGroup, dtype_from_name, init_weight_group
from tandem.weights.meta import WeightUpdateMeta
from tandem.weights.receive import receive
from tandem.weights.updater import WeightUpdater
from tests.inference.conftest import make_model_dir
from tests.weights.common import BUCKET, FAST, CheckpointSource

pytestmark = pytest.mark.timeout(120)


class TensorParallelStandIn:
    """One server of `devices` workers on SGLang's weight routes; `received[j]`: worker j's tensors."""

    def __init__(self, devices: int):
        self.devices = devices
        self.groups: list[WeightGroup | None] = [None] * devices
        self.received: list[dict[str, torch.Tensor]] = [{} for _ in range(devices)]
        self.joined_as: list[tuple[int, int]] = []  # (rank, world) of each worker's join
        self.pool = ThreadPoolExecutor(devices)
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])) or b"{}")
                try:
                    message = owner.handle(self.path, body)
                    answer, status = {"success": True, "message": message}, 200
                except Exception as exc:  # answered as SGLang does: success false, the reason
                    answer, status = {"success": False, "message": f"{type(exc).__name__}: {exc}"}, 200
                data = json.dumps(answer).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: Any) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def on_every_worker(self, fn) -> list[Any]:
        return [f.result(60) for f in [self.pool.submit(fn, j) for j in range(self.devices)]]

    def handle(self, path: str, body: dict[str, Any]) -> str:
        if path == "/init_weights_update_group":
            def join(tp_rank: int) -> None:
                rank, world = int(body["rank_offset"]) + tp_rank, int(body["world_size"])
                self.groups[tp_rank] = init_weight_group(body["master_address"], int(body["master_port"]), rank,
                                                         world, body["group_name"], body["backend"], timeout_s=30)
                self.joined_as.append((rank, world))

            self.on_every_worker(join)
        elif path == "/update_weights_from_distributed":
            dtypes = [dtype_from_name(d) for d in body["dtypes"]]

            def take(tp_rank: int) -> None:
                tensors = receive(self.groups[tp_rank], body["shapes"], dtypes)
                self.received[tp_rank].update(zip(body["names"], tensors, strict=True))

            self.on_every_worker(take)
        elif path == "/destroy_weights_update_group":
            self.on_every_worker(lambda j: self.groups[j].destroy())
        return "ok"

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.pool.shutdown(wait=False)


def test_one_group_over_servers_of_one_two_and_four_devices(tmp_path):
    model = make_model_dir(tmp_path, "qwen3", seed=3)
    servers = [TensorParallelStandIn(n) for n in (1, 2, 4)]
    source = CheckpointSource(model, scale=1.5)
    try:
        devices = {s.url: s.devices for s in servers}
        with HttpFleet([s.url for s in servers], adapter=SGLangAdapter(), deadlines=FAST, devices=devices) as fleet:
            assert fleet.world_size == 7
            meta = WeightUpdateMeta(type="distributed", bucket_bytes=BUCKET, deadlines=FAST)
            with WeightUpdater(source, fleet, meta, keep_group=False) as updater:
                report = updater.update(1)
        assert report.buckets >= 5
        assert sorted(servers[0].joined_as + servers[1].joined_as + servers[2].joined_as) == [(r, 8) for r in
                                                                                            range(1, 8)]
        assert sorted(servers[1].joined_as) == [(2, 8), (3, 8)] and sorted(servers[2].joined_as)[0] == (4, 8)
        for server in servers:
            for tensors in server.received:
                assert tensors.keys() == source.tensors.keys()
                for name, want in source.tensors.items():
                    assert torch.equal(tensors[name], want), name
    finally:
        for s in servers:
            s.close()

"""AReaL's distributed weight update, replayed against a real `tandem serve`.

Written from AReaL's code (inclusionAI/AReaL at 4aef98d), not from our server's:
- the trainer side forms the group as `FSDPEngine._init_weight_update_from_distributed`
  (areal/engine/fsdp_engine.py) does, through `init_custom_process_group`
  (areal/engine/core/distributed.py): torch's `tcp://` rendezvous as rank 0 of `world_size`, a
  `PrefixStore(group_name)`, torch's `_new_process_group_helper`, group name
  "update_weight_group", with `TORCHELASTIC_USE_AGENT_STORE=False`;
- the init request is `SGLangBackend.build_init_weights_group_request` (areal/engine/sglang_remote.py,
  PP=1): `master_port` as a string, `rank_offset = 1 + server_idx * tp * pp`, `world_size = gen
  world size + 1`, the platform's backend (gloo on CPU), sent before the trainer joins;
- each bucket is `build_distributed_weight_update_requests`: `names`, `dtypes` (torch dtype names
  without "torch."), `shapes`, `group_name`, `abort_all_requests: true` (no version, no commit), the
  request sent first, then one `dist.broadcast(src=0, group=pg)` per tensor, as
  `FSDPEngine._update_bucket_weights_from_distributed_async` does; buckets are a partial set each;
- `_update_weights_from_distributed` wraps them in `/pause_generation {}` ... `/continue_generation {}`
  (AReaL keeps the version on its side: `RemoteInfEngine.set_version` sends nothing).
"""

from __future__ import annotations

import multiprocessing as mp
import socket
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from tandem.models.hf_checkpoint import iter_hf_tensors
from tandem.weights.verify import tensor_checksum
from tests.inference.conftest import make_model_dir
from tests.inference.server_utils import ServerProcess

GROUP = "update_weight_group"


def _areal_trainer(port: int, cmd_q, result_q) -> None:
    """Trainer rank 0 as AReaL forms its weight-update group, then broadcasts on command."""
    import datetime
    import os

    import torch.distributed as dist
    from torch.distributed.distributed_c10d import (
        Backend,
        PrefixStore,
        _new_process_group_helper,
        _world,
        rendezvous,
    )

    os.environ["TORCHELASTIC_USE_AGENT_STORE"] = str(False)
    timeout = datetime.timedelta(seconds=30)
    try:
        store, rank, world_size = next(rendezvous(f"tcp://127.0.0.1:{port}", 0, 2, timeout=timeout))
        store.set_timeout(timeout)
        pg, _ = _new_process_group_helper(world_size, rank, [], Backend("gloo"), PrefixStore(GROUP, store),
                                          group_name=GROUP, timeout=timeout, group_desc=GROUP)
        _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
        result_q.put(("joined", None))
        while True:
            tensors = cmd_q.get()
            if tensors is None:
                break
            handles = [dist.broadcast(t, src=0, group=pg, async_op=True) for t in tensors]
            for h in handles:
                h.wait()
            result_q.put(("sent", len(tensors)))
        dist.destroy_process_group(pg)
    except Exception as exc:  # reported to the test, which fails on it
        result_q.put(("error", repr(exc)))


def _free_port() -> int:
    with socket.socket() as s:  # AReaL: find_free_ports(1)
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(qwen3_dir, tmp_path_factory):
    srv = ServerProcess(qwen3_dir, tmp_path_factory.mktemp("serve"), "--weight-sync-timeout", "30")
    yield srv
    assert srv.stop() == 0, srv.log.read_text()


def _bucket(tensors: list[tuple[str, torch.Tensor]]) -> dict:
    return {"names": [n for n, _ in tensors], "dtypes": [str(t.dtype).split("torch.")[1] for _, t in tensors],
            "shapes": [list(t.shape) for _, t in tensors], "group_name": GROUP, "abort_all_requests": True}


def test_areal_trainer_updates_tandem_serve_in_two_partial_buckets(server, qwen3_dir, tmp_path):
    new = list(iter_hf_tensors(make_model_dir(tmp_path, "qwen3", seed=3)))
    old = dict(iter_hf_tensors(qwen3_dir))
    first, second = new[: len(new) // 2], new[len(new) // 2:]
    want = {n: tensor_checksum(t.contiguous()) for n, t in new}
    assert all(want[n] != tensor_checksum(old[n].contiguous()) for n, _ in new)

    def served() -> dict[str, str]:
        return server.ok("/get_weights_checksum", {})["checksums"]

    ctx = mp.get_context("spawn")
    cmd_q, result_q = ctx.Queue(), ctx.Queue()
    port = _free_port()
    trainer = ctx.Process(target=_areal_trainer, args=(port, cmd_q, result_q), daemon=True)
    try:
        with ThreadPoolExecutor(2) as pool:
            init = pool.submit(server.ok, "/init_weights_update_group", {
                "master_address": "127.0.0.1", "master_port": str(port), "rank_offset": 1, "world_size": 2,
                "backend": "gloo", "group_name": GROUP})
            trainer.start()
            assert result_q.get(timeout=60) == ("joined", None)
            assert init.result(60)["success"] is True
            server.ok("/pause_generation", {})
            for k, bucket in enumerate((first, second)):
                answer = pool.submit(server.ok, "/update_weights_from_distributed", _bucket(bucket))
                cmd_q.put([t.contiguous() for _, t in bucket])
                assert result_q.get(timeout=60) == ("sent", len(bucket))
                assert answer.result(60)["success"] is True
                sums = served()
                # Each call's tensors are in place at once (SGLang's semantics), the rest untouched.
                done = {n for part in (first, second)[: k + 1] for n, _ in part}
                assert {n for n, _ in new if sums[n] == want[n]} == done
            server.ok("/continue_generation", {})
            cmd_q.put(None)
            trainer.join(30)
            assert trainer.exitcode == 0
    finally:
        if trainer.is_alive():
            trainer.kill()
    assert served() == want
    server.ok("/destroy_weights_update_group", {"group_name": GROUP})
    out = server.ok("/generate", {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2, "temperature": 0}})
    assert len(out["output_ids"]) == 2

"""AReaL's side of the SGLang protocol, written from AReaL's code (inclusionAI/AReaL:
`areal/engine/sglang_remote.py`'s `SGLangBackend` and `RemoteSGLangEngine`, the FSDP engine's
weight-update group in `areal/engine/fsdp_engine.py` and `areal/engine/core/distributed.py`), for
tests that replay what AReaL sends against a real `tandem serve`."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import socket
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import torch

GROUP = "update_weight_group"


def areal_generate_body(input_ids: list[int], max_new_tokens: int, temperature: float, ignore_eos: bool = False) -> dict:
    """The body AReaL's `SGLangBackend.build_generation_request` (areal/engine/sglang_remote.py,
    inclusionAI/AReaL) posts to /generate, with `GenerationHyperparameters`' defaults
    (areal/api/cli_args.py): top_k int(1e8), stop_token_ids [], no stop, no LoRA."""
    sample_params = {
        "top_p": 1.0,
        "top_k": int(1e8),
        "max_new_tokens": max_new_tokens,
        "temperature": temperature,
        "stop_token_ids": [],
        "ignore_eos": ignore_eos,
        "skip_special_tokens": True,
        "frequency_penalty": 0.0,
    }
    return {"input_ids": list(input_ids), "image_data": None, "sampling_params": sample_params,
            "return_logprob": True, "stream": False}


def areal_parse(response: dict) -> tuple[list[int], list[float], str]:
    """What `SGLangBackend.parse_generation_response` reads (same file): finish_reason's type and
    message, and tokens/logprobs from meta_info.output_token_logprobs unless 'Abort before prefill'."""
    meta_info = response["meta_info"]
    finish_reason = meta_info["finish_reason"]
    stop_reason = finish_reason["type"]
    if stop_reason == "abort" and finish_reason.get("message", "").startswith("Abort before prefill"):
        return [], [], stop_reason
    return ([x[1] for x in meta_info["output_token_logprobs"]], [x[0] for x in meta_info["output_token_logprobs"]],
            stop_reason)


def areal_trainer(port: int, cmd_q, result_q) -> None:
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


def free_port() -> int:
    with socket.socket() as s:  # AReaL: find_free_ports(1)
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def bucket_request(tensors: list[tuple[str, torch.Tensor]]) -> dict:
    return {"names": [n for n, _ in tensors], "dtypes": [str(t.dtype).split("torch.")[1] for _, t in tensors],
            "shapes": [list(t.shape) for _, t in tensors], "group_name": GROUP, "abort_all_requests": True}


@contextlib.contextmanager
def areal_group_update(server) -> Iterator[Callable[[list[tuple[str, torch.Tensor]]], None]]:
    """AReaL's distributed update of `server` (a `ServerProcess`): the init request sent first and
    the trainer (`areal_trainer`, a spawned process) joining, `/pause_generation {}`; yields
    `send(bucket)`, which posts one bucket's request and broadcasts its tensors, checking both
    succeeded; on leaving, `/continue_generation {}` and the trainer leaves."""
    ctx = mp.get_context("spawn")
    cmd_q, result_q = ctx.Queue(), ctx.Queue()
    port = free_port()
    trainer = ctx.Process(target=areal_trainer, args=(port, cmd_q, result_q), daemon=True)
    try:
        with ThreadPoolExecutor(2) as pool:
            init = pool.submit(server.ok, "/init_weights_update_group", {
                "master_address": "127.0.0.1", "master_port": str(port), "rank_offset": 1, "world_size": 2,
                "backend": "gloo", "group_name": GROUP})
            trainer.start()
            assert result_q.get(timeout=60) == ("joined", None)
            assert init.result(60)["success"] is True
            assert server.ok("/pause_generation", {})["success"] is True

            def send(bucket: list[tuple[str, torch.Tensor]]) -> None:
                answer = pool.submit(server.ok, "/update_weights_from_distributed", bucket_request(bucket))
                cmd_q.put([t.contiguous() for _, t in bucket])
                assert result_q.get(timeout=60) == ("sent", len(bucket))
                assert answer.result(60)["success"] is True

            yield send
            assert server.ok("/continue_generation", {})["success"] is True
            cmd_q.put(None)
            trainer.join(30)
            assert trainer.exitcode == 0
    finally:
        if trainer.is_alive():
            trainer.kill()

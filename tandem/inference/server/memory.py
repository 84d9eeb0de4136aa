"""Memory release and resume for colocated training, on the engine thread: the data plane behind
`/release_memory_occupation` and `/resume_memory_occupation` (routes in `memory_routes.py`).
"""

from __future__ import annotations

from typing import Any

import torch

from tandem.inference.engine import LLMEngine
from tandem.inference.errors import EngineBusyError

MEMORY_TAGS = ("kv_cache", "weights")


def release_memory(engine: LLMEngine, tags: list[str], host: dict[str, Any]) -> None:
    """Engine thread. kv_cache: free the KV tensor (the prefix cache goes with it). weights: move
    every parameter to host memory (on a CPU device that is where they already are: the copy is
    the parameter itself, so nothing is freed)."""
    if engine.has_unfinished():
        raise EngineBusyError("cannot release memory while requests are in flight; pause generation first")
    runner = engine.runner
    if "kv_cache" in tags and "kv_cache" not in host:
        host["kv_cache"] = (tuple(runner.kv_cache.shape), runner.kv_cache.dtype)
        engine.block_manager.flush()
        runner.kv_cache = torch.empty(0, dtype=runner.kv_cache.dtype, device=runner.device)
        runner.attn.k_caches, runner.attn.v_caches = runner.layer_caches()
    if "weights" in tags and "weights" not in host:
        params = dict(engine.model.named_parameters())
        host["weights"] = {n: p.data.to("cpu") for n, p in params.items()}
        for p in params.values():
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)
    if engine.device.type == "cuda":
        torch.cuda.empty_cache()


def resume_memory(engine: LLMEngine, tags: list[str], host: dict[str, Any]) -> None:
    runner = engine.runner
    if "kv_cache" in tags and "kv_cache" in host:
        shape, dtype = host.pop("kv_cache")
        runner.kv_cache = torch.zeros(shape, dtype=dtype, device=runner.device)
        runner.attn.k_caches, runner.attn.v_caches = runner.layer_caches()
    if "weights" in tags and "weights" in host:
        saved = host.pop("weights")
        for n, p in engine.model.named_parameters():
            p.data = saved[n].to(engine.device)

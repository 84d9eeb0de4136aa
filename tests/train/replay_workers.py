"""Worker body of the context-parallel routing-replay test (module level, so spawn can import it)."""

from __future__ import annotations

import torch

from tandem.train import TrainEngine
from tests.train.helpers import engine_config


def sft_like_loss(logprobs: torch.Tensor, entropy: torch.Tensor, mb) -> torch.Tensor:
    return -(logprobs * mb.tokens["loss_mask"].float()).sum()


def replay_forward(rank: int, world_size: int, path: str, batch, cp: int) -> dict:
    """r3 + load-balancing loss at `cp`: the recorded routes, log-probs and agreement counts of a
    forward, then one forward/backward's stats and the first router's full gradient."""
    del rank, world_size
    engine = TrainEngine(engine_config(path, cp=cp, router_replay="r3", moe_aux_loss_coef=0.1))
    try:
        out = engine.forward_logprobs(batch, record_experts=True)
        stats = engine.forward_backward(batch, sft_like_loss)
        grad = engine.model.layers["0"].moe.router.weight.grad
        grad = grad.full_tensor() if hasattr(grad, "full_tensor") else grad
        return {"logprobs": out.logprobs, "routes": out.routed_experts, "counts": (out.route_matches, out.route_pairs),
                "stats": stats, "grad": grad.clone()}
    finally:
        engine.close()


def replay_layouts(rank: int, world_size: int, path: str, batch, layouts: list[dict]) -> list[dict]:
    """r3 forward with recorded routes under each engine layout (e.g. `{"ep": 2}`, `{"tp": 2}`,
    `{"tp": 2, "etp": 2}`); every rank forwards the whole batch."""
    del rank, world_size
    out = []
    for layout in layouts:
        engine = TrainEngine(engine_config(path, router_replay="r3", **layout))
        try:
            res = engine.forward_logprobs(batch, record_experts=True)
            out.append({"logprobs": res.logprobs, "routes": res.routed_experts,
                        "counts": (res.route_matches, res.route_pairs)})
        finally:
            engine.close()
    return out

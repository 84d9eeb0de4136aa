"""Routed experts in the training batch: routing replay (`actor.router_replay`) and route agreement.

A sequence may carry `[L, moe layers, top_k]` expert ids in input alignment (a row with a
negative id is unknown and routes live): `ROUTED_EXPERTS`, what the rollout server used, and
`PROX_ROUTED_EXPERTS`, what the trainer's proximal pass used (r2). `routing_for` turns a
micro-batch's rows into the `Routing` its forward replays and records (off / r2 / r3); the
agreement counts (token, MoE layer) pairs whose live top-k set equals the server's. The modes,
the layout under CP/TP/EP and the agreement metric: docs/training.md, "MoE routing replay".
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import torch

from tandem.errors import ConfigError
from tandem.models.common.moe import Routing

if TYPE_CHECKING:
    from tandem.train.config import TrainEngineConfig

ROUTED_EXPERTS = "routed_experts"
PROX_ROUTED_EXPERTS = "prox_routed_experts"
# Which batch key each mode replays.
REPLAY_KEYS = {"off": None, "r2": PROX_ROUTED_EXPERTS, "r3": ROUTED_EXPERTS}


def routing_for(
    tokens: Mapping[str, torch.Tensor], mode: str, moe_layers: Sequence[int], top_k: int, *,
    record: bool = False, keep_logits: bool = False,
) -> Routing | None:
    """The `Routing` of one micro-batch's forward (`tokens`: its per-token values in input
    alignment, `[T, ...]`): replays the routed experts `mode` names when the micro-batch has them,
    records the ids used when `record`, the live top-k when it carries the server's (for agreement), the
    router logits when `keep_logits`. None when there is nothing to do (dense models included)."""
    if not moe_layers:
        return None
    key = REPLAY_KEYS[mode]
    replay = tokens.get(key) if key is not None else None
    live = ROUTED_EXPERTS in tokens
    if replay is None and not (record or live or keep_logits):
        return None
    routing = Routing(record=record, keep_logits=keep_logits, record_live=live)
    if replay is not None:
        routing.replay = split_layers(replay, moe_layers, top_k, key)
    return routing


def split_layers(experts: torch.Tensor, moe_layers: Sequence[int], top_k: int, name: str = "routed experts"
                 ) -> dict[int, torch.Tensor]:
    """`[T, len(moe_layers), top_k]` -> `{layer index: [T, top_k]}` (the model's block indices)."""
    expected = (len(moe_layers), top_k)
    if experts.ndim != 3 or tuple(experts.shape[1:]) != expected:
        raise ValueError(f"{name} has shape {tuple(experts.shape)}, expected [tokens, {expected[0]} MoE layers, "
                         f"top_k={expected[1]}] for this model")
    return {layer: experts[:, i] for i, layer in enumerate(moe_layers)}


def stack_layers(per_layer: Mapping[int, torch.Tensor], moe_layers: Sequence[int]) -> torch.Tensor:
    """`{layer: [T, top_k]}` -> `[T, len(moe_layers), top_k]` int32 (the batch layout)."""
    missing = [layer for layer in moe_layers if layer not in per_layer]
    if missing:
        raise ValueError(f"no experts recorded for MoE layers {missing}")
    return torch.stack([per_layer[layer] for layer in moe_layers], dim=1).to(torch.int32)


def agreement_counts(live: torch.Tensor, server: torch.Tensor) -> tuple[int, int]:
    """(matching pairs, pairs) over the (token, layer) pairs of `[T, layers, top_k]` expert ids where
    the server's row is known (no negative id): a pair matches when both top-k *sets* are equal."""
    if live.shape != server.shape:
        raise ValueError(f"live experts {tuple(live.shape)} and server experts {tuple(server.shape)} differ in shape")
    known = (server >= 0).all(-1)
    same = (torch.sort(live.long(), -1).values == torch.sort(server.long(), -1).values).all(-1)
    return int((same & known).sum()), int(known.sum())


def agreement_of(routing: Routing | None, tokens: Mapping[str, torch.Tensor], moe_layers: Sequence[int]
                 ) -> tuple[int, int]:
    """`agreement_counts` of a forward that ran with `routing_for(tokens, ...)`; (0, 0) when the
    micro-batch has no routed experts from the server."""
    if routing is None or not routing.record_live or ROUTED_EXPERTS not in tokens:
        return 0, 0
    live = stack_layers(routing.live, moe_layers)
    return agreement_counts(live, tokens[ROUTED_EXPERTS].to(live.device))


def fill_missing_routed_experts(seqs: Sequence[dict], moe_shape: tuple[int, int] | None = None) -> None:
    """Make `ROUTED_EXPERTS` a key of every sequence or of none (a `SequenceBatch` needs the same
    keys everywhere): when some sequences have them, the others get rows of -1 (route live)."""
    shapes = {tuple(s[ROUTED_EXPERTS].shape[1:]) for s in seqs if ROUTED_EXPERTS in s}
    if not shapes:
        return
    if len(shapes) > 1:
        raise ValueError(f"sequences carry routed experts of different shapes {sorted(shapes)} (MoE layers, top_k)")
    shape = moe_shape or shapes.pop()
    for s in seqs:
        if ROUTED_EXPERTS not in s:
            s[ROUTED_EXPERTS] = torch.full((int(s["input_ids"].shape[0]), *shape), -1, dtype=torch.int32)


def check_moe_options(config: TrainEngineConfig, moe_layers: Sequence[int], pipelined: bool) -> None:
    """router_replay and moe_aux_loss_coef need MoE layers (`moe_layers`) and a model that is not
    pipelined; router_replay_live_mismatch needs r3 (the live forward is compared with the replayed
    one). Raises `ConfigError` naming the option."""
    if config.router_replay_live_mismatch and config.router_replay != "r3":
        raise ConfigError(f"router_replay_live_mismatch=True logs the mismatch of a live-routed forward next to "
                          f"the replayed one and needs router_replay='r3', not {config.router_replay!r}; "
                          "set router_replay=r3 or router_replay_live_mismatch=False")
    used = [k for k, on in (("router_replay", config.router_replay != "off"),
                            ("moe_aux_loss_coef", config.moe_aux_loss_coef > 0)) if on]
    if not used:
        return
    if not moe_layers:
        raise ConfigError(f"{used[0]}={getattr(config, used[0])!r} applies to mixture-of-experts models; "
                          f"{config.path!r} has no MoE layers")
    if pipelined:
        raise ConfigError(f"{used[0]}={getattr(config, used[0])!r} is not supported with pipeline "
                          "parallelism (routed experts are not passed to the stages)")
    if config.moe_aux_loss_coef > 0 and config.tp > 1:
        raise ConfigError(f"moe_aux_loss_coef={config.moe_aux_loss_coef:g} is not supported with tensor "
                          "parallelism yet (each TP rank holds the router logits of its own tokens)")

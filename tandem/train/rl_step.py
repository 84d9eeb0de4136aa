"""The decoupled-PPO update of one trainer rank (`TrainWorker.ppo_update`).

Called on every rank with its own shard; everything inside is collective over the data-parallel
group.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from tandem.algo.config import AlgoConfig
from tandem.algo.losses import (
    ValueLoss,
    make_policy_loss,
    policy_loss_weight,
    reduce_stats,
    set_prox_logprobs,
    summarize_stats,
)
from tandem.algo.mismatch import batch_logprob_mismatch
from tandem.data.batch import SequenceBatch
from tandem.train.dist import all_reduce_sum
from tandem.train.routed_experts import PROX_ROUTED_EXPERTS, ROUTED_EXPERTS

# The live-routed forward's logprobs, held in the shard (input alignment) only while its mismatch is computed.
LIVE_LOGPROBS = "live_logprobs"

if TYPE_CHECKING:
    from tandem.train.engine import TrainEngine


def ppo_update(
    engine: TrainEngine, shard: SequenceBatch, algo: AlgoConfig, version: int, temperature: float,
    n_minibatches: int = 1,
) -> dict[str, float]:
    """Decoupled PPO on this rank's shard: proximal logprobs with the weights of `version`, then
    one optimizer step per minibatch. With one minibatch the training forward itself runs those
    weights, so it supplies the proximal logprobs (no extra pass); with several, a separate forward
    pass computes them first. Returns stats reduced over all ranks.

    MoE routing replay (`engine.config.router_replay`, see `tandem.train.routed_experts`): r3
    replays the server's routed experts in every forward (the shard must carry them); r2 replays,
    in the update passes, the experts of a forward at the proximal weights. That forward is the
    proximal pass when there are several minibatches (it also runs under `prox_logp="loglinear"`,
    for the experts alone); with one minibatch the update forward runs the proximal weights
    itself, so its live experts are the ones r2 would replay and no pass is added. `moe/route_agreement` comes from the
    first forward that sees each token: the proximal pass when it runs, else the update passes.
    With r3 and `engine.config.router_replay_live_mismatch`, one more no-grad forward at the
    proximal weights routes live and logs its mismatch (`moe/mismatch_live/{mean,max}`)."""
    stats: dict[str, float] = {}
    mode = engine.config.router_replay
    if mode == "r3" and not (shard.seqs and ROUTED_EXPERTS in shard.seqs[0]):
        raise ValueError("actor.router_replay='r3' but the batch carries no routed_experts: the rollout servers "
                         "returned no routes (they must be asked for return_routed_experts)")
    fused = algo.ppo.prox_logp == "recompute" and n_minibatches == 1
    record = mode == "r2" and n_minibatches > 1
    route_counts: list[float] | None = None
    if (algo.ppo.prox_logp == "recompute" and not fused) or record:
        prox = engine.forward_logprobs(shard, temperature=temperature, loss_tokens_only=True, record_experts=record)
        if algo.ppo.prox_logp == "recompute":
            set_prox_logprobs(shard, prox.logprobs)
            stats.update(_reduce_mismatch(batch_logprob_mismatch(shard, version), engine))
        if record:
            for seq, experts in zip(shard.seqs, prox.routed_experts or [], strict=True):
                seq[PROX_ROUTED_EXPERTS] = experts
        route_counts = all_reduce_sum([prox.route_matches, prox.route_pairs], engine.device, engine.dp_group)
    if engine.config.router_replay_live_mismatch:  # before any update: the proximal weights
        stats.update(_live_mismatch(engine, shard, temperature))
    loss_stats: dict[str, Any] = {}
    loss = make_policy_loss(algo.ppo, version=version, stats=loss_stats, prox_from_forward=fused)
    train_stats: list[dict[str, float]] = []
    for part in _minibatches(shard, n_minibatches):
        train_stats.append(engine.train_batch(part, loss, policy_loss_weight, temperature=temperature))
    reduce_stats(loss_stats, engine.dp_group)
    if engine.pipeline is not None:  # the loss ran on the last stage only
        loss_stats = engine.pipeline.from_last_stage(loss_stats)
    summary = summarize_stats(loss_stats)
    if fused:
        stats.update(_fused_mismatch(summary))
    stats.update({f"ppo/{k}": v for k, v in summary.items()})
    if route_counts is None:
        route_counts = [sum(s.get(f"route_{k}", 0.0) for s in train_stats) for k in ("matches", "pairs")]
    if route_counts[1]:
        stats.update({"moe/route_agreement": route_counts[0] / route_counts[1], "moe/route_pairs": route_counts[1]})
    if "aux_loss" in train_stats[0]:
        stats["moe/aux_loss"] = sum(s["aux_loss"] for s in train_stats) / len(train_stats)
    last = train_stats[-1]
    stats.update({
        "train/loss": sum(s["loss"] for s in train_stats) / len(train_stats),
        "train/grad_norm": last["grad_norm"],
        "train/lr": last["lr"],
        "train/n_tokens": sum(s["n_tokens"] for s in train_stats),
        "train/n_loss_tokens": sum(s["n_loss_tokens"] for s in train_stats),
    })
    return stats


def value_update(engine: TrainEngine, shard: SequenceBatch, algo: AlgoConfig, n_minibatches: int = 1) -> dict[str, float]:
    """The critic's update on this rank's shard, which carries the old `values` and the `returns`
    (input alignment): one optimizer step per minibatch (the same split as the actor's) on the
    clipped value loss (`algo.ppo.value_eps_clip`). Returns `critic/*` stats reduced over ranks."""
    loss_stats: dict[str, Any] = {}
    loss = ValueLoss(algo.ppo, stats=loss_stats)
    train_stats = [engine.train_batch(part, loss, policy_loss_weight) for part in _minibatches(shard, n_minibatches)]
    reduce_stats(loss_stats, engine.dp_group)
    summary = summarize_stats(loss_stats)
    last = train_stats[-1]
    return {
        "critic/value_loss": summary.get("value_loss", 0.0),
        "critic/value_clip_frac": summary.get("value_clip_frac", 0.0),
        "critic/grad_norm": last["grad_norm"],
        "critic/lr": last["lr"],
    }


def _minibatches(shard: SequenceBatch, n: int) -> list[SequenceBatch]:
    """`n` contiguous minibatches (each rank's shard is already balanced; order is arbitrary)."""
    size = -(-len(shard) // n)
    return [shard.select(range(i, min(i + size, len(shard)))) for i in range(0, len(shard), size)] or [shard]


def _fused_mismatch(summary: dict[str, float]) -> dict[str, float]:
    """The `mismatch/*` stats from the policy loss's own records (its logprobs are pi_prox when
    `prox_from_forward`), already reduced over ranks: same keys as `_reduce_mismatch`."""
    return {
        "mismatch/mean": summary.get("prox_behave_absdiff", 0.0),
        "mismatch/max": summary.get("prox_behave_absdiff_max", 0.0),
        "mismatch/n_tokens": summary.get("n_loss_tokens", 0.0),
        "mismatch/current_mean": summary.get("theta_behave_absdiff", 0.0),
        "mismatch/current_max": summary.get("theta_behave_absdiff_max", 0.0),
        "mismatch/current_n_tokens": summary.get("n_current_tokens", 0.0),
    }


def _live_mismatch(engine: TrainEngine, shard: SequenceBatch, temperature: float) -> dict[str, float]:
    """`moe/mismatch_live/{mean,max}`: the `mismatch/{mean,max}` of a no-grad forward of `shard`
    that routes every token live (no replay), over the same loss tokens, reduced over ranks alike."""
    live = engine.forward_logprobs(shard, temperature=temperature, loss_tokens_only=True, live_routing=True)
    set_prox_logprobs(shard, live.logprobs, key=LIVE_LOGPROBS)
    try:
        local = batch_logprob_mismatch(shard, recomputed_key=LIVE_LOGPROBS)
    finally:
        for seq in shard.seqs:
            del seq[LIVE_LOGPROBS]
    reduced = _reduce_mismatch(local, engine, prefixes=("mismatch/",))
    return {f"moe/mismatch_live/{k}": reduced[f"mismatch/{k}"] for k in ("mean", "max")}


def _reduce_mismatch(local: dict[str, float], engine: TrainEngine,
                     prefixes: Sequence[str] = ("mismatch/", "mismatch/current_")) -> dict[str, float]:
    """Token-weighted means and maxima of the logprob mismatch (`{prefix}{mean,max,n_tokens}`,
    by default `mismatch/[current_]...`) over all data-parallel ranks."""
    out: dict[str, float] = {}
    for prefix in prefixes:
        n, mean, peak = (float(local.get(f"{prefix}{k}", 0.0)) for k in ("n_tokens", "mean", "max"))
        sums = torch.tensor([n, mean * n], dtype=torch.float64, device=engine.device)
        top = torch.tensor([peak], dtype=torch.float64, device=engine.device)
        if dist.is_initialized():
            dist.all_reduce(sums, group=engine.dp_group)
            dist.all_reduce(top, op=dist.ReduceOp.MAX, group=engine.dp_group)
        total = float(sums[0])
        out[f"{prefix}mean"] = float(sums[1]) / total if total else 0.0
        out[f"{prefix}max"] = float(top[0])
        out[f"{prefix}n_tokens"] = total
    return out

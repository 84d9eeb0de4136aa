"""From accepted trajectories to the training batch: shaped rewards, dynamic filtering, advantages."""

from __future__ import annotations

import torch

from tandem.algo.advantages import add_advantages, dynamic_filter
from tandem.algo.config import AlgoConfig
from tandem.algo.rewards import shape_rewards
from tandem.data.trajectory import Trajectory
from tandem.train.batch import SequenceBatch
from tandem.train.routes import fill_missing_routes


def build_training_batch(
    trajs: list[Trajectory], algo: AlgoConfig, version: int
) -> tuple[SequenceBatch | None, dict[str, float]]:
    """A `SequenceBatch` with per-token `advantages`, or None when filtering dropped everything.

    Advantages are computed here, on the controller, over the whole batch: group normalisation
    needs every sample of a group, and data-parallel ranks only ever see a shard.
    """
    raw = torch.tensor([t.reward for t in trajs], dtype=torch.float32)
    lengths = [sum(t.loss_mask) for t in trajs]
    shaped = shape_rewards(raw, algo.reward, lengths)
    group_ids = [t.group_id for t in trajs]
    stats: dict[str, float] = {
        **staleness_stats(trajs, version),
        "reward/mean": float(raw.mean()),
        "reward/shaped_mean": float(shaped.mean()),
        "gen/response_len_mean": sum(lengths) / len(lengths),
        "gen/response_len_max": float(max(lengths)),
        "gen/truncated_frac": sum(t.finish_reasons[-1:] == ["length"] for t in trajs) / len(trajs),
    }
    kept = list(range(len(trajs)))
    if algo.ppo.dynamic_filtering:
        result = dynamic_filter(shaped, group_ids)
        kept = result.kept_indices
        stats.update({f"filter/{k}": float(v) for k, v in result.stats.items()})
        if not kept:
            return None, stats
    seqs = [trajs[i].to_tensors() for i in kept]
    fill_missing_routes(seqs)  # a trajectory the server returned no routes for routes live
    batch = SequenceBatch(seqs)
    adv = add_advantages(batch, algo.advantage, group_ids=[group_ids[i] for i in kept], rewards=shaped[kept])
    stats.update({f"adv/{k}": float(v) for k, v in adv.items()})
    return batch, stats


def staleness_stats(trajs: list[Trajectory], version: int) -> dict[str, float]:
    """How old the batch's tokens are when the trainer at `version` consumes them."""
    gen = [t for t in trajs if t.generated_versions()]
    if not gen:
        return {}
    return {
        "staleness/max": float(max(version - t.min_version for t in gen)),
        "staleness/mean": sum(version - t.min_version for t in gen) / len(gen),
        "staleness/mixed_version_frac": sum(t.min_version != t.max_version for t in gen) / len(gen),
    }

"""From accepted trajectories to the training batch, in two halves (PPO's advantages need the
reference's `ref_logprobs` and the critic's `values`, which the trainer ranks add in between):

    tb, stats = build_training_batch(trajs, algo, version)     # shaped rewards, dynamic filtering
    stats |= add_training_advantages(tb, algo)                 # KL reward term, GAE, normalisation

Advantages are computed on the controller over the whole batch: group normalisation needs every
sample of a group, and data-parallel ranks only ever see a shard."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tandem.algo.advantages import add_advantages, dynamic_filter
from tandem.algo.config import AlgoConfig
from tandem.algo.losses import BEHAVE_LOGPROBS, OLD_VALUES, REF_LOGPROBS, RETURNS
from tandem.algo.rewards import kl_estimate, shape_rewards
from tandem.data.batch import LOSS_MASK, SequenceBatch
from tandem.data.trajectory import Trajectory
from tandem.train.routed_experts import fill_missing_routed_experts

KL_REWARDS = "kl_rewards"  # the per-token reward term `add_advantages` adds before GAE
TEACHER_LOGPROBS = "teacher_logprobs"  # `Trajectory.teacher_logprobs`: a teacher's scores (distillation)


@dataclass
class TrainingBatch:
    """The sequences to train on (input alignment) with their shaped outcome rewards and groups."""

    batch: SequenceBatch
    rewards: torch.Tensor  # [B] shaped
    group_ids: list[str]

    def __len__(self) -> int:
        return len(self.batch)


def build_training_batch(trajs: list[Trajectory], algo: AlgoConfig,
                         version: int) -> tuple[TrainingBatch | None, dict[str, float]]:
    """The kept sequences and their shaped rewards (None when filtering dropped everything), and
    the batch's reward, length and staleness stats. No advantages yet: `add_training_advantages`."""
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
    fill_missing_routed_experts(seqs)  # a trajectory without routed experts routes live
    return TrainingBatch(SequenceBatch(seqs), shaped[kept], [group_ids[i] for i in kept]), stats


def add_training_advantages(tb: TrainingBatch, algo: AlgoConfig) -> dict[str, float]:
    """Per-token `advantages` and `returns` in every sequence, in place; the stats.

    - With `ref_logprobs` in the sequences (a reference model, `algo.ppo.kl_ctl > 0`): the KL of the
      behaviour policy to the reference on the sampled tokens, `ppo/kl_ref` (token mean), and,
      unless `kl_in_loss`, the reward term `-kl_ctl * KL` on every generated token.
    - With `teacher_logprobs` (a run with a teacher): `add_teacher_rewards`.
    - With `values` (a critic's, input alignment: V of the state before each token): GAE on them,
      and `critic/values_mean`, `critic/returns_mean`, `critic/explained_variance`
      (1 - Var(R - V) / Var(R) over generated tokens: how much of the returns the critic predicts).
    """
    seqs = tb.batch.seqs
    stats: dict[str, float] = {}
    ppo = algo.ppo
    if seqs and REF_LOGPROBS in seqs[0]:
        total, count = 0.0, 0.0
        for seq in seqs:
            mask = seq[LOSS_MASK].float()
            kl = kl_estimate(seq[BEHAVE_LOGPROBS], seq[REF_LOGPROBS], ppo.kl_estimator) * mask
            total, count = total + float(kl.sum()), count + float(mask.sum())
            if not ppo.kl_in_loss:
                seq[KL_REWARDS] = -ppo.kl_ctl * kl
        stats["ppo/kl_ref"] = total / count if count else 0.0
    if seqs and TEACHER_LOGPROBS in seqs[0]:
        stats.update(add_teacher_rewards(tb.batch, algo.distill.kl_coef))
    adv = add_advantages(tb.batch, algo.advantage, group_ids=tb.group_ids, rewards=tb.rewards,
                         values_key=OLD_VALUES, token_reward_key=KL_REWARDS)
    stats.update({f"adv/{k}": float(v) for k, v in adv.items()})
    if seqs and OLD_VALUES in seqs[0]:
        stats.update(critic_stats(tb.batch))
    return stats


def add_teacher_rewards(batch: SequenceBatch, kl_coef: float) -> dict[str, float]:
    """On-policy distillation, in place: `kl_coef * (logp_teacher - logp_behave)` joins every
    generated token's reward term (`kl_rewards`, next to a reference's KL), the negative of the
    single-sample estimate of the reverse KL(student || teacher) at that token; the teacher's
    logprobs then leave the sequences (the trainer ranks do not need them). Stats:
    `distill/reverse_kl` (token mean of logp_behave - logp_teacher) and `distill/teacher_logprob`."""
    total_kl, total_teacher, count = 0.0, 0.0, 0.0
    for seq in batch.seqs:
        mask = seq[LOSS_MASK].float()
        teacher = seq.pop(TEACHER_LOGPROBS).float()
        kl = (seq[BEHAVE_LOGPROBS].float() - teacher) * mask
        total_kl, total_teacher = total_kl + float(kl.sum()), total_teacher + float((teacher * mask).sum())
        count += float(mask.sum())
        seq[KL_REWARDS] = seq.get(KL_REWARDS, torch.zeros_like(kl)) - kl_coef * kl
    return {"distill/reverse_kl": total_kl / count if count else 0.0,
            "distill/teacher_logprob": total_teacher / count if count else 0.0}


def critic_stats(batch: SequenceBatch) -> dict[str, float]:
    """`critic/values_mean`, `critic/returns_mean` and `critic/explained_variance` over the
    generated tokens of sequences carrying `values` and `returns`."""
    masks = [s[LOSS_MASK].bool() for s in batch.seqs]
    values = torch.cat([s[OLD_VALUES].double()[m] for s, m in zip(batch.seqs, masks, strict=True)])
    returns = torch.cat([s[RETURNS].double()[m] for s, m in zip(batch.seqs, masks, strict=True)])
    if not values.numel():
        return {}
    var = float(returns.var(unbiased=False))
    explained = 1.0 - float((returns - values).var(unbiased=False)) / var if var > 0 else 0.0
    return {"critic/values_mean": float(values.mean()), "critic/returns_mean": float(returns.mean()),
            "critic/explained_variance": explained}


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

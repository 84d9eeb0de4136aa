"""Every `algo.*` key reaches what `tandem train` computes with it: each case loads the run config
twice, once with the key changed, and shows that what the trainer's code does with `cfg.algo`
changes: the training batch (`tandem.rl.batch.build_training_batch`: reward shaping, dynamic
filtering, advantages) or the decoupled PPO loss (`tandem.algo.make_policy_loss`). The exact
formulas are pinned down with hand-computed values in test_rewards, test_advantages and test_losses;
these tests catch a key that is accepted by the loader but no longer changes anything."""

from __future__ import annotations

import math

import pytest
import torch

from tandem.algo import make_policy_loss
from tandem.algo.losses import ADVANTAGES, BEHAVE_LOGPROBS, OLD_VALUES, PROX_LOGPROBS, REF_LOGPROBS, VERSIONS
from tandem.data.trajectory import Trajectory
from tandem.rl.batch import add_training_advantages, build_training_batch
from tandem.rl.config import load_run_config
from tandem.train import MicroBatch

MAX_NEW = 8  # gen.max_new_tokens of every case: the overlong penalty measures against it
PENALTY = ["algo.reward.overlong_penalty.enabled=true", "algo.reward.overlong_penalty.overlong_tokens=3"]
RAW = ["algo.advantage.mean_level=none", "algo.advantage.std_level=none"]  # advantage = shaped reward


def _trajectories() -> list[Trajectory]:
    """Two groups of three: `a` with rewards 3, 0, 1 (lengths 8, 3, 6 generated tokens), `b` all
    rewarded 1 (a group dynamic filtering drops)."""
    out = []
    for group, rewards, lengths in (("a", [3.0, 0.0, 1.0], [8, 3, 6]), ("b", [1.0, 1.0, 1.0], [2, 8, 4])):
        for reward, n in zip(rewards, lengths, strict=True):
            out.append(Trajectory(input_ids=[1, 2] + [5] * n, loss_mask=[0, 0] + [1] * n, logprobs=[0.0] * (n + 2),
                                  versions=[-1, -1] + [0] * n, reward=reward, prompt_id=group, group_id=group))
    return out


def _batch(overrides: list[str]) -> list[list[float]]:
    """The advantages `tandem train` computes: with a reference (kl_ctl > 0) or a critic, the
    sequences first get what those models return (fixed numbers here: logprob -0.5, value 0.3)."""
    cfg = load_run_config(None, [f"gen.max_new_tokens={MAX_NEW}", *overrides])
    tb, _ = build_training_batch(_trajectories(), cfg.algo, version=1)
    assert tb is not None
    for seq in tb.batch.seqs:
        if cfg.algo.ppo.kl_ctl > 0:
            seq[REF_LOGPROBS] = torch.full_like(seq[BEHAVE_LOGPROBS], -0.5)
        if cfg.algo.ppo.use_critic:
            seq[OLD_VALUES] = torch.full_like(seq[BEHAVE_LOGPROBS], 0.3)
    add_training_advantages(tb, cfg.algo)
    return [seq["advantages"].tolist() for seq in tb.batch.seqs]


BATCH_CASES = {  # key -> (the overrides both runs share, the key's changed value)
    "algo.reward.reward_bias": (RAW, "0.5"),
    "algo.reward.reward_scaling": (RAW, "2.0"),
    "algo.reward.reward_clip": (RAW, "0.5"),
    "algo.reward.overlong_penalty.enabled": ([*RAW, "algo.reward.overlong_penalty.overlong_tokens=3"], "true"),
    "algo.reward.overlong_penalty.overlong_tokens": (RAW + PENALTY, "6"),
    "algo.reward.overlong_penalty.factor": (RAW + PENALTY, "3.0"),
    "algo.advantage.mean_level": (["algo.advantage.std_level=none"], "batch"),
    "algo.advantage.std_level": ([], "batch"),
    "algo.advantage.leave_one_out": (["algo.advantage.std_level=none"], "true"),
    "algo.advantage.unbiased_std": ([], "true"),
    "algo.advantage.eps": ([], "1.0"),
    "algo.ppo.dynamic_filtering": ([], "true"),
    "algo.advantage.gamma": (RAW, "0.5"),
    "algo.advantage.lam": (RAW, "0.5"),
    "algo.name": ([], "ppo"),  # a critic: GAE on its values, batch-normalised token advantages
    "algo.ppo.kl_ctl": (RAW, "0.1"),
    "algo.ppo.kl_estimator": ([*RAW, "algo.ppo.kl_ctl=0.1"], "k2"),
    "algo.ppo.kl_in_loss": ([*RAW, "algo.ppo.kl_ctl=0.1"], "true"),
}


@pytest.mark.parametrize("key", list(BATCH_CASES))
def test_the_key_changes_the_training_batch(key):
    """Catches an `algo.reward.*` / `algo.advantage.*` / dynamic-filtering key that the loader
    accepts but `build_training_batch` no longer reads: the batch (its advantages, or for dynamic
    filtering the sequences kept) must change with the key."""
    shared, value = BATCH_CASES[key]
    before, after = _batch(shared), _batch([*shared, f"{key}={value}"])
    print(f"\n{key}={value}: first advantages {before[0][:3]} -> {after[0][:3]}; {len(before)} -> {len(after)} sequences")
    assert before != after


def _policy_mb() -> MicroBatch:
    """Two sequences of three tokens, every one sampled one version back (behaviour version 1,
    trainer at version 2). Sequence 1: PPO ratios 1.1, 1.3 (advantage +1) and 5 (advantage -1);
    sequence 2: ratio 1, behaviour weights e^1, e^2, e^-1."""
    prox = torch.tensor([-1.0, -1.0, -1.0, -1.0, -1.0, -1.0])
    behave = prox - torch.tensor([0.0, 0.0, 0.0, 1.0, 2.0, -1.0])
    tokens = {
        "loss_mask": torch.ones(6, dtype=torch.long),
        BEHAVE_LOGPROBS: behave,
        PROX_LOGPROBS: prox,
        ADVANTAGES: torch.tensor([1.0, 1.0, -1.0, 1.0, 1.0, 1.0]),
        VERSIONS: torch.ones(6, dtype=torch.long),
    }
    cu = torch.tensor([0, 3, 6], dtype=torch.int32)
    return MicroBatch([0, 1], torch.zeros(6, dtype=torch.long), cu, tokens)


THETA = torch.tensor([-1.0 + math.log(1.1), -1.0 + math.log(1.3), -1.0 + math.log(5.0), -1.0, -1.0, -1.0])


def _loss(overrides: list[str]) -> float:
    cfg = load_run_config(None, overrides)
    return make_policy_loss(cfg.algo.ppo, version=2)(THETA.clone(), torch.zeros(6), _policy_mb()).item()


LOSS_CASES = {
    "algo.ppo.eps_clip": "0.05",
    "algo.ppo.eps_clip_higher": "0.5",
    "algo.ppo.dual_clip": "3.0",
    "algo.ppo.behave_imp_weight_cap": "2.0",
    "algo.ppo.behave_imp_weight_mode": "clamp",
    "algo.ppo.behave_imp_weight_level": "sequence",
    # The ratio's level defines GSPO (algo.name refuses it otherwise): GSPO with GRPO's clip and
    # behaviour-weight level, so that only the importance level differs from GRPO.
    "algo.ppo.importance_level": ["algo.name=gspo", "algo.ppo.importance_level=sequence", "algo.ppo.eps_clip=0.2",
                                  "algo.ppo.eps_clip_higher=null", "algo.ppo.behave_imp_weight_level=token"],
    "algo.ppo.prox_logp": "loglinear",
}


@pytest.mark.parametrize("key", list(LOSS_CASES))
def test_the_key_changes_the_policy_loss(key):
    """Catches an `algo.ppo.*` loss key that the loader accepts but the policy loss no longer
    reads: on a micro-batch where every clip, cap and level matters, the loss must change."""
    case = LOSS_CASES[key]
    changed = case if isinstance(case, list) else [f"{key}={case}"]
    before, after = _loss([]), _loss(changed)
    print(f"\n{changed}: loss {before:.6f} -> {after:.6f}")
    assert not math.isclose(before, after, rel_tol=1e-6, abs_tol=1e-9)

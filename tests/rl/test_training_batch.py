"""The controller's half of a PPO step on hand-computed numbers: the KL of the behaviour policy to
the reference as a reward term (or only a statistic, when the KL is in the loss), GAE on the
critic's values, and the critic's statistics; the teacher's reverse KL of distillation."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tandem.algo.config import recipe
from tandem.data.trajectory import Trajectory
from tandem.rl.batch import KL_REWARDS, TEACHER_LOGPROBS, add_training_advantages, build_training_batch


def _batch(kl_in_loss: bool):
    """Two samples of one prompt: behaviour logprobs from the server, the reference's and the
    critic's outputs as the trainer ranks return them (input alignment)."""
    trajs = [Trajectory.from_generation([5], [6, 7], [-1.0, -2.0], [0, 0], reward=1.0, group_id="g"),
             Trajectory.from_generation([5], [8], [-0.5], [0], reward=0.0, group_id="g")]
    algo = recipe("ppo", kl_ctl=0.1, kl_in_loss=kl_in_loss)
    algo.advantage = dataclasses.replace(algo.advantage, mean_level="none", std_level="none", lam=1.0)
    tb, _ = build_training_batch(trajs, algo, version=0)
    for seq, ref, values in zip(tb.batch.seqs, ([0.0, -1.5, -1.0], [0.0, -0.5]), ([9.0, 0.5, 0.25], [9.0, 0.2]),
                                strict=True):
        seq["ref_logprobs"], seq["values"] = torch.tensor(ref), torch.tensor(values)
    return tb, algo


def close(t, want):
    assert t.tolist() == pytest.approx(want, abs=1e-6)


def test_kl_reward_and_gae_on_the_critics_values():
    # k1 = logp_behave - logp_ref: sample 1: 0.5, -1.0; sample 2: 0 -> ppo/kl_ref = -0.5 / 3.
    # Reward term -0.1 * k1: [-0.05, 0.1]; the outcome 1.0 on the last token -> r = [-0.05, 1.1].
    # GAE (gamma = lambda = 1) on V = [0.5, 0.25], terminal 0:
    #   t1: 1.1 - 0.25 = 0.85; t0: -0.05 + 0.25 - 0.5 = -0.3, A0 = -0.3 + 0.85 = 0.55; R = A + V = 1.05, 1.1
    # Sample 2: r = [0], V = [0.2]: A = -0.2, R = 0.
    tb, algo = _batch(kl_in_loss=False)
    stats = add_training_advantages(tb, algo)
    first, second = tb.batch.seqs
    close(first[KL_REWARDS], [0.0, -0.05, 0.1])
    close(first["advantages"], [0.0, 0.55, 0.85])
    close(first["returns"], [0.0, 1.05, 1.1])
    close(second["advantages"], [0.0, -0.2])
    close(second["returns"], [0.0, 0.0])
    assert stats["ppo/kl_ref"] == pytest.approx(-0.5 / 3)
    # Over generated tokens: V = [0.5, 0.25, 0.2], R = [1.05, 1.1, 0]; R - V = [0.55, 0.85, -0.2].
    v, r = torch.tensor([0.5, 0.25, 0.2]), torch.tensor([1.05, 1.1, 0.0])
    assert stats["critic/values_mean"] == pytest.approx(0.95 / 3)
    assert stats["critic/returns_mean"] == pytest.approx(2.15 / 3)
    explained = 1 - (r - v).var(unbiased=False) / r.var(unbiased=False)  # 1 - 0.195 / 0.2572222
    assert stats["critic/explained_variance"] == pytest.approx(float(explained), abs=1e-6)
    assert stats["critic/explained_variance"] == pytest.approx(1 - 0.195 / (0.771666667 / 3), abs=1e-6)


def test_with_the_kl_in_the_loss_the_rewards_are_the_outcomes_alone():
    # No reward term: r = [0, 1.0]; t1: 1 - 0.25 = 0.75; t0: 0.25 - 0.5 = -0.25, A0 = 0.5.
    tb, algo = _batch(kl_in_loss=True)
    stats = add_training_advantages(tb, algo)
    first = tb.batch.seqs[0]
    assert KL_REWARDS not in first
    close(first["advantages"], [0.0, 0.5, 0.75])
    assert stats["ppo/kl_ref"] == pytest.approx(-0.5 / 3)  # still measured


def test_the_batch_builder_pairs_rewards_with_their_trajectories_and_filters_whole_groups():
    """Catches: rewards or groups shifted against the sequences (e.g. by filtering), a group kept
    whose rewards are all equal under DAPO, and a batch that filtering emptied not reported as one
    (the loop's skipped step). Hand-worked: group a = (1, 0), group b = (1, 1), group c = (0, 0.5)."""
    rewards = {"a": [1.0, 0.0], "b": [1.0, 1.0], "c": [0.0, 0.5]}
    trajs = [Trajectory.from_generation([10 + i], [20 + i] * (1 + i), [-1.0] * (1 + i), [0] * (1 + i), reward=r,
                                        group_id=g)
             for i, (g, r) in enumerate((g, r) for g, rs in rewards.items() for r in rs)]
    tb, stats = build_training_batch(trajs, recipe("dapo", max_new_tokens=8), version=0)
    # Group b is dropped; the others keep their own tokens, rewards and groups, in order.
    assert [s["input_ids"][0].item() for s in tb.batch.seqs] == [10, 11, 14, 15]
    assert [len(s["input_ids"]) for s in tb.batch.seqs] == [2, 3, 6, 7]
    assert tb.group_ids == ["a", "a", "c", "c"]
    close(tb.rewards, [1.0, 0.0, 0.0, 0.5])
    assert stats["filter/n_groups"] == 3 and stats["filter/n_groups_kept"] == 2
    assert stats["reward/mean"] == pytest.approx(3.5 / 6)
    # GRPO advantages on the kept groups: (r - group mean) / (group std + 1e-5), on generated tokens only.
    add_training_advantages(tb, recipe("grpo"))
    want = [0.5 / (0.5 + 1e-5), -0.5 / (0.5 + 1e-5), -0.25 / (0.25 + 1e-5), 0.25 / (0.25 + 1e-5)]
    for seq, a in zip(tb.batch.seqs, want, strict=True):
        close(seq["advantages"], [0.0] + [a] * (len(seq["input_ids"]) - 1))
    # Every group solved alike: nothing to train on, and the stats say why.
    solved = [dataclasses.replace(t, reward=1.0) for t in trajs]
    empty, stats = build_training_batch(solved, recipe("dapo", max_new_tokens=8), version=0)
    assert empty is None and stats["filter/n_groups_kept"] == 0


def test_dispatch_balances_tokens_and_shares_the_sequences():
    """Catches: an unbalanced split, a sequence lost or duplicated, and shards holding copies (the
    reference's logprobs and the critic's values are attached through the shards). Lengths 9, 5, 1, 5
    on two ranks: the contiguous split loads 14 / 6 (imbalance 1.4); the balanced one {9, 1} / {5, 5}."""
    from tandem.data.batch import SequenceBatch
    from tandem.rl.dispatch import split_for_ranks

    batch = SequenceBatch([{"input_ids": torch.arange(n), "loss_mask": torch.ones(n, dtype=torch.long)}
                           for n in (9, 5, 1, 5)])
    shards, stats = split_for_ranks(batch, 2)
    assert sorted(sorted(s.lengths) for s in shards) == [[1, 9], [5, 5]]
    assert stats["dispatch/imbalance_naive"] == pytest.approx(1.4) and stats["dispatch/imbalance"] == 1.0
    held = [id(seq) for s in shards for seq in s.seqs]
    assert sorted(held) == sorted(id(seq) for seq in batch.seqs)  # each sequence once, the same object


def _distilled(algo):
    """Two samples scored by a teacher (`Trajectory.teacher_logprobs`, input alignment)."""
    trajs = [Trajectory.from_generation([5], [6, 7], [-1.0, -2.0], [0, 0], reward=1.0, group_id="g"),
             Trajectory.from_generation([5], [8], [-0.5], [0], reward=0.0, group_id="g")]
    trajs[0].teacher_logprobs = [0.0, -0.25, -3.0]
    trajs[1].teacher_logprobs = [0.0, -0.5]
    tb, _ = build_training_batch(trajs, algo, version=0)
    return tb


def test_distill_advantage_is_each_tokens_own_teacher_minus_student():
    # k1 reverse KL per token, logp_behave - logp_teacher: [-0.75, 1.0] and [0.0].
    # The recipe: kl_coef 1, outcome scaled to 0, gamma 0, no normalisation: A_t = teacher - behave.
    tb = _distilled(recipe("distill"))
    stats = add_training_advantages(tb, recipe("distill"))
    first, second = tb.batch.seqs
    close(first["advantages"], [0.0, 0.75, -1.0])
    close(second["advantages"], [0.0, 0.0])
    assert TEACHER_LOGPROBS not in first  # consumed on the controller; the ranks never get it
    assert stats["distill/reverse_kl"] == pytest.approx(0.25 / 3)
    assert stats["distill/teacher_logprob"] == pytest.approx(-3.75 / 3)


def test_a_teacher_term_joins_grpos_advantages():
    # GRPO with kl_coef 0.5: group-normalised outcomes (1, 0) -> (+1, -1) on the last token (std
    # eps 1e-5), the term 0.5 * (teacher - behave) on each token, summed to go (gamma = lambda = 1):
    # sample 1 terms [0.375, -0.5] -> A = [0.375 - 0.5 + 1, -0.5 + 1] = [0.875, 0.5]; sample 2: [-1].
    algo = recipe("grpo")
    algo.distill.kl_coef = 0.5
    tb = _distilled(algo)
    add_training_advantages(tb, algo)
    first, second = tb.batch.seqs
    close(first[KL_REWARDS], [0.0, 0.375, -0.5])
    assert first["advantages"].tolist() == pytest.approx([0.0, 0.875, 0.5], abs=1e-4)
    assert second["advantages"].tolist() == pytest.approx([0.0, -1.0], abs=1e-4)

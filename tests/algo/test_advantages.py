"""Advantages: normalisation levels, leave-one-out, GAE and dynamic filtering, hand-computed."""

from __future__ import annotations

import math

import pytest
import torch

from tandem.algo import (
    AdvantageConfig,
    add_advantages,
    compute_advantages,
    dynamic_filter,
    gae,
    group_index,
    normalize,
    recipe,
)
from tandem.errors import ConfigError
from tandem.train import SequenceBatch


def close(a, b, tol=1e-6):
    torch.testing.assert_close(torch.as_tensor(a, dtype=torch.float64), torch.tensor(b, dtype=torch.float64),
                               atol=tol, rtol=0)


X = torch.tensor([1.0, 3.0, 2.0, 4.0, 6.0])
G = torch.tensor([0, 0, 1, 1, 1])  # group A = [1, 3], group B = [2, 4, 6]


def test_rloo_worked_examples():
    # Leave-one-out batch mean, no std. [1,2,3,4]: sum 10, baselines 9/3, 8/3, 7/3, 6/3
    # -> 1-3 = -2, 2-8/3 = -2/3, 3-7/3 = 2/3, 4-2 = 2.
    close(normalize(torch.tensor([1.0, 2, 3, 4]), "batch", "none", leave_one_out=True), [-2, -2 / 3, 2 / 3, 2])
    # [10,20,30]: sum 60, baselines 25, 20, 15 -> -15, 0, 15.
    close(normalize(torch.tensor([10.0, 20, 30]), "batch", "none", leave_one_out=True), [-15, 0, 15])
    # The RLOO recipe does it per group: both examples in one batch give the same numbers.
    cfg = recipe("rloo").advantage
    x = torch.tensor([1.0, 2, 3, 4, 10, 20, 30])
    out = normalize(x, cfg.mean_level, cfg.std_level, group_index(list("aaaabbb")), leave_one_out=True)
    close(out, [-2, -2 / 3, 2 / 3, 2, -15, 0, 15], tol=1e-5)
    # A sample alone in its group has no leave-one-out baseline: baseline 0.
    close(normalize(torch.tensor([5.0]), "group", "none", torch.tensor([0]), leave_one_out=True), [5.0])


def test_grpo_group_mean_and_std():
    # Group A [1,3]: mean 2, std (biased) 1 -> -1, 1. Group B [2,4,6]: mean 4,
    # std (biased) sqrt(8/3) = 1.6329932 -> -2/1.633, 0, 2/1.633 = -1.2247449, 0, 1.2247449.
    s = math.sqrt(8 / 3)
    close(normalize(X, "group", "group", G, eps=0.0), [-1, 1, -2 / s, 0, 2 / s])
    # eps is added to the std: 1 / (1 + 1e-5).
    close(normalize(X, "group", "group", G, eps=1e-5)[:2], [-1 / (1 + 1e-5), 1 / (1 + 1e-5)], tol=1e-7)
    # Unbiased std: A sqrt(2/1) = 1.4142136 -> -0.7071068, 0.7071068; B sqrt(8/2) = 2 -> -1, 0, 1.
    close(normalize(X, "group", "group", G, unbiased_std=True, eps=0.0), [-1 / math.sqrt(2), 1 / math.sqrt(2), -1, 0, 1])
    # A group whose rewards are all equal gets 0 (0 / (0 + eps)).
    close(normalize(torch.tensor([5.0, 5.0]), "group", "group", torch.tensor([0, 0])), [0.0, 0.0])


def test_dr_grpo_group_mean_no_std():
    # A: [1,3] - 2 = -1, 1; B: [2,4,6] - 4 = -2, 0, 2.
    cfg = recipe("dr_grpo").advantage
    close(normalize(X, cfg.mean_level, cfg.std_level, G), [-1, 1, -2, 0, 2])


def test_batch_level_mean_std_and_mixed_levels():
    # [1,2,3,4]: mean 2.5, std sqrt(1.25) = 1.1180340 -> -1.3416408, -0.4472136, 0.4472136, 1.3416408
    s = math.sqrt(1.25)
    close(normalize(torch.tensor([1.0, 2, 3, 4]), "batch", "batch", eps=0.0), [-1.5 / s, -0.5 / s, 0.5 / s, 1.5 / s])
    # Group mean, batch std: centred [-1, 1, -2, 0, 2]; batch std of [1,3,2,4,6]: mean 3.2,
    # squared deviations 4.84 + 0.04 + 1.44 + 0.64 + 7.84 = 14.8, / 5 = 2.96, sqrt = 1.7204651.
    s = math.sqrt(2.96)
    close(normalize(X, "group", "batch", G, eps=0.0), [-1 / s, 1 / s, -2 / s, 0, 2 / s])
    # No mean, group std: A: 1/1, 3/1; B: [2,4,6] / 1.6329932.
    s = math.sqrt(8 / 3)
    close(normalize(X, "none", "group", G, eps=0.0), [1, 3, 2 / s, 4 / s, 6 / s])
    close(normalize(X, "none", "none"), X.tolist())
    with pytest.raises(ConfigError, match="group ids"):
        normalize(X, "group", "none")
    with pytest.raises(ConfigError, match="baseline"):
        normalize(X, "none", "none", leave_one_out=True)


def test_outcome_reward_spread_over_generated_tokens():
    # Two samples of one prompt, rewards 1 and 0: group mean 0.5, std 0.5 -> +1, -1 (eps 0).
    # gamma = lambda = 1: every generated token of a sample gets its sample's advantage;
    # prompt and feedback tokens (mask 0) get 0 — multi-turn gaps included.
    masks = [torch.tensor([0, 0, 1, 1, 0, 1]), torch.tensor([0, 1, 1])]
    cfg = AdvantageConfig(mean_level="group", std_level="group", eps=0.0)
    out = compute_advantages(masks, [1.0, 0.0], cfg, group_ids=["p", "p"])
    close(out.advantages[0], [0, 0, 1, 1, 0, 1])
    close(out.advantages[1], [0, -1, -1])
    assert out.stats["reward_mean"] == 0.5
    # gamma 0.5, no critic: reward-to-go discounted from the last generated token: 0.25, 0.5, 1.
    out = compute_advantages([torch.tensor([0, 1, 1, 1])], [1.0], AdvantageConfig(mean_level="none", std_level="none", gamma=0.5))
    close(out.advantages[0], [0, 0.25, 0.5, 1.0])
    # KL token rewards add to the tokens' rewards: with gamma 1, A_t = sum of rewards from t on:
    # kl = [-, -0.1, -0.2, -0.3] and outcome 1 at the end -> 0.4, 0.5, 0.7.
    out = compute_advantages([torch.tensor([0, 1, 1, 1])], [1.0], AdvantageConfig(mean_level="none", std_level="none"),
                             token_rewards=[torch.tensor([9.0, -0.1, -0.2, -0.3])])
    close(out.advantages[0], [0, 0.4, 0.5, 0.7])


def test_gae_three_tokens():
    # r = [0, 0, 1], V = [0.5, 0.6, 0.7], gamma 0.9, lambda 0.8, terminal V = 0:
    # t=2: delta = 1 + 0.9*0 - 0.7 = 0.3;           A2 = 0.3
    # t=1: delta = 0 + 0.9*0.7 - 0.6 = 0.03;        A1 = 0.03 + 0.72*0.3 = 0.246
    # t=0: delta = 0 + 0.9*0.6 - 0.5 = 0.04;        A0 = 0.04 + 0.72*0.246 = 0.21712
    # returns = A + V = 0.71712, 0.846, 1.0
    adv, ret = gae([torch.tensor([0.0, 0.0, 1.0])], [torch.tensor([0.5, 0.6, 0.7])], gamma=0.9, lam=0.8)
    close(adv[0], [0.21712, 0.246, 0.3])
    close(ret[0], [0.71712, 0.846, 1.0])
    # Through compute_advantages with a critic (2 prompt tokens, no normalisation): same numbers,
    # scattered to the generated positions; a shorter sequence in the batch does not disturb it.
    cfg = AdvantageConfig(mean_level="none", std_level="none", gamma=0.9, lam=0.8)
    out = compute_advantages(
        [torch.tensor([0, 0, 1, 1, 1]), torch.tensor([0, 1])],
        [1.0, 2.0],
        cfg,
        values=[torch.tensor([9.0, 9.0, 0.5, 0.6, 0.7]), torch.tensor([9.0, 0.5])],
    )
    close(out.advantages[0], [0, 0, 0.21712, 0.246, 0.3])
    close(out.returns[0], [0, 0, 0.71712, 0.846, 1.0])
    close(out.advantages[1], [0, 1.5])  # 2 - 0.5
    # With batch normalisation of token advantages: mean of [0.21712, 0.246, 0.3, 1.5] = 0.5657800.
    cfg = AdvantageConfig(mean_level="batch", std_level="none", gamma=0.9, lam=0.8)
    out = compute_advantages([torch.tensor([0, 0, 1, 1, 1]), torch.tensor([0, 1])], [1.0, 2.0], cfg,
                             values=[torch.tensor([9.0, 9.0, 0.5, 0.6, 0.7]), torch.tensor([9.0, 0.5])])
    m = (0.21712 + 0.246 + 0.3 + 1.5) / 4
    close(out.advantages[0], [0, 0, 0.21712 - m, 0.246 - m, 0.3 - m], tol=1e-6)
    close(out.returns[0], [0, 0, 0.71712, 0.846, 1.0])  # returns are not normalised


def test_add_advantages_on_a_batch():
    batch = SequenceBatch.from_token_lists(
        [[1, 2, 3], [4, 5, 6, 7], [8, 9]], loss_mask=[[0, 1, 1], [0, 0, 1, 1], [0, 1]], reward=[1.0, 3.0, 5.0]
    )
    # Dr.GRPO in one group: rewards 1, 3, 5 - mean 3 -> -2, 0, 2 on generated tokens.
    stats = add_advantages(batch, recipe("dr_grpo").advantage, group_ids=[0, 0, 0])
    close(batch.seqs[0]["advantages"], [0, -2, -2])
    close(batch.seqs[1]["advantages"], [0, 0, 0, 0])
    close(batch.seqs[2]["advantages"], [0, 2])
    assert stats["adv_max"] == 2.0 and "returns" in batch.seqs[0]


def test_dynamic_filtering():
    # Groups a [1,1,1] (all equal: drop), b [0,1,0] (keep), c [0,0] (drop), d [5] (alone: drop).
    res = dynamic_filter([1, 1, 1, 0, 1, 0, 0, 0, 5], list("aaabbbccd"))
    assert res.kept_indices == [3, 4, 5]
    assert res.keep.tolist() == [False] * 3 + [True] * 3 + [False] * 3
    assert res.stats == {"n_groups": 4, "n_groups_kept": 1, "n_samples_kept": 3, "frac_groups_filtered": 0.75}

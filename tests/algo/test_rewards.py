"""Reward shaping with hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from tandem.algo import (
    OverlongPenaltyConfig,
    RewardConfig,
    kl_estimate,
    kl_rewards,
    overlong_penalty,
    shape_rewards,
)


def close(a, b, tol=1e-6):
    torch.testing.assert_close(torch.as_tensor(a, dtype=torch.float64), torch.tensor(b, dtype=torch.float64),
                               atol=tol, rtol=0)


def test_dapo_overlong_penalty():
    # max_new_tokens 20, zone 4 tokens: expected = 16. lengths 10, 16, 18, 20 -> exceed -6, 0, 2, 4
    # -> -exceed / 4 * 1 = 1.5, 0, -0.5, -1 -> min(., 0) = 0, 0, -0.5, -1.
    close(overlong_penalty([10, 16, 18, 20], 20, 4, 1.0), [0.0, 0.0, -0.5, -1.0])
    # factor 2 doubles it: 0, 0, -1, -2.
    close(overlong_penalty([10, 16, 18, 20], 20, 4, 2.0), [0.0, 0.0, -1.0, -2.0])
    cfg = RewardConfig(max_new_tokens=20, overlong_penalty=OverlongPenaltyConfig(enabled=True, overlong_tokens=4))
    # rewards 1 each: 1 + penalty = 1, 1, 0.5, 0.
    close(shape_rewards([1, 1, 1, 1], cfg, [10, 16, 18, 20]), [1.0, 1.0, 0.5, 0.0])
    with pytest.raises(ValueError, match="response_lengths"):
        shape_rewards([1.0], cfg)


def test_reward_bias_scale_clip():
    # (r + 0.5) * 2 then clip to [-5, 5]: 1 -> 3; -4 -> -7 -> -5; 10 -> 21 -> 5; 0 -> 1.
    cfg = RewardConfig(reward_bias=0.5, reward_scaling=2.0, reward_clip=5.0)
    close(shape_rewards([1.0, -4.0, 10.0, 0.0], cfg), [3.0, -5.0, 5.0, 1.0])
    # Defaults leave rewards alone.
    close(shape_rewards([0.0, 1.0, -3.0], RewardConfig()), [0.0, 1.0, -3.0])


def test_kl_estimators_and_clamp():
    lp = torch.tensor([-1.0, -2.0, -0.5, -30.0])
    lr = torch.tensor([-1.5, -1.0, -0.5, -1.0])
    # d = lp - lr = 0.5, -1, 0, -29
    close(kl_estimate(lp, lr, "k1"), [0.5, -1.0, 0.0, -10.0])  # -29 clamped to -10
    close(kl_estimate(lp, lr, "k2"), [0.125, 0.5, 0.0, 10.0])  # d^2/2; 420.5 clamped to 10
    # k3 = exp(-d) - 1 + d: e^-0.5 - 0.5 = 0.1065307; e - 2 = 0.7182818; 0; e^29 - 30 -> 10
    close(kl_estimate(lp, lr, "k3"), [math.exp(-0.5) - 0.5, math.e - 2, 0.0, 10.0])
    # reward term -kl_ctl * KL, masked: 0.1 * k1 -> -0.05, 0.1, 0 (masked), 1.0
    close(kl_rewards(lp, lr, 0.1, "k1", torch.tensor([1, 1, 0, 1])), [-0.05, 0.1, 0.0, 1.0])

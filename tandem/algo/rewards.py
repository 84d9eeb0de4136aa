"""Reward shaping: the DAPO overlong penalty, bias/scale/clip, and the KL-to-reference reward term.

All functions are pure tensor maps (no grad needed). Outcome rewards are one float per sample;
KL rewards are per token and are added to the token rewards before advantages (the KL term goes
into the reward, not into the loss).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tandem.algo.config import KL_ESTIMATORS, RewardConfig
from tandem.errors import ConfigError

KL_CLAMP = 10.0


def _vec(x: torch.Tensor | Sequence[float]) -> torch.Tensor:
    return torch.as_tensor(x, dtype=torch.float32).flatten()


def overlong_penalty(
    response_lengths: torch.Tensor | Sequence[int], max_new_tokens: int, overlong_tokens: int, factor: float
) -> torch.Tensor:
    """DAPO soft overlong penalty per sample (<= 0).

    `expected = max_new_tokens - overlong_tokens`, `exceed = length - expected`,
    `penalty = min(-exceed / overlong_tokens * factor, 0)`: zero up to `expected` tokens, then
    linear down to `-factor` at `max_new_tokens`.
    """
    if overlong_tokens <= 0:
        raise ConfigError("overlong_penalty.overlong_tokens must be > 0")
    lengths = _vec(response_lengths)
    exceed = lengths - float(max_new_tokens - overlong_tokens)
    return torch.clamp(-exceed / overlong_tokens * factor, max=0.0)


def shape_rewards(
    rewards: torch.Tensor | Sequence[float],
    cfg: RewardConfig,
    response_lengths: torch.Tensor | Sequence[int] | None = None,
) -> torch.Tensor:
    """Outcome rewards `[B]` -> shaped rewards `[B]` (float32).

    `r += overlong_penalty(len)` when enabled, then `r = clip((r + bias) * scaling, -clip, clip)`.
    """
    r = _vec(rewards).clone()
    pen = cfg.overlong_penalty
    if pen.enabled:
        if response_lengths is None:
            raise ValueError("the overlong penalty needs response_lengths (generated tokens per sample)")
        r = r + overlong_penalty(response_lengths, cfg.max_new_tokens, pen.overlong_tokens, pen.factor)
    r = (r + cfg.reward_bias) * cfg.reward_scaling
    return torch.clamp(r, -cfg.reward_clip, cfg.reward_clip)


def kl_estimate(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: str = "k1") -> torch.Tensor:
    """Per-token estimate of KL(policy || reference) from the sampled token's logprobs, clamped to
    [-10, 10]. With `d = logp - ref_logp`: k1 = d, k2 = d^2 / 2, k3 = exp(-d) - 1 + d."""
    d = logp.float() - ref_logp.float()
    if estimator == "k1":
        kl = d
    elif estimator == "k2":
        kl = d.square() / 2
    elif estimator == "k3":
        kl = torch.exp(-d) - 1 + d
    else:
        raise ConfigError(f"kl_estimator {estimator!r} is not one of {', '.join(KL_ESTIMATORS)}")
    return torch.clamp(kl, -KL_CLAMP, KL_CLAMP)


def kl_rewards(
    logp: torch.Tensor,
    ref_logp: torch.Tensor,
    kl_ctl: float,
    estimator: str = "k1",
    loss_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-token reward term `-kl_ctl * KL_t` (0 where `loss_mask` is 0). Any alignment works as
    long as the three tensors share it."""
    out = -kl_ctl * kl_estimate(logp, ref_logp, estimator)
    if loss_mask is not None:
        out = out * loss_mask.float()
    return out

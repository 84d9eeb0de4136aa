"""Advantages: mean/std normalisation at batch or group level, leave-one-out baselines, outcome
rewards spread over generated tokens, GAE with a critic, and DAPO's dynamic filtering.

Per-sequence tensors are in *input alignment* (position t describes token t, as in
`tandem.data.batch`): `loss_mask[t] = 1` on generated tokens. Everything here runs once per
batch, without grad, on the controller (or any rank: it is deterministic).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from tandem.algo.config import LEVELS, AdvantageConfig
from tandem.data.batch import LOSS_MASK, SequenceBatch
from tandem.errors import ConfigError

GroupIds = Sequence[Hashable] | torch.Tensor


def group_index(group_ids: GroupIds) -> torch.Tensor:
    """Dense group indices `[B]` (0..G-1, in order of first appearance) from any hashable ids."""
    if isinstance(group_ids, torch.Tensor):
        group_ids = group_ids.tolist()
    seen: dict[Hashable, int] = {}
    return torch.tensor([seen.setdefault(g, len(seen)) for g in group_ids], dtype=torch.long)


def _scope(level: str, n: int, groups: torch.Tensor | None) -> torch.Tensor:
    if level == "batch":
        return torch.zeros(n, dtype=torch.long)
    if level == "group":
        if groups is None:
            raise ConfigError("group-level normalisation needs group ids (which samples share a prompt)")
        return groups.long()
    raise ConfigError(f"normalisation level {level!r} is not one of {', '.join(LEVELS)}")


def _scope_sums(x: torch.Tensor, scope: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-element sum and count of its scope."""
    k = int(scope.max()) + 1 if scope.numel() else 0
    sums = torch.zeros(k, dtype=x.dtype).index_add_(0, scope, x)
    counts = torch.bincount(scope, minlength=k).to(x.dtype)
    return sums[scope], counts[scope]


def normalize(
    x: torch.Tensor,
    mean_level: str = "batch",
    std_level: str = "batch",
    groups: torch.Tensor | None = None,
    *,
    leave_one_out: bool = False,
    unbiased_std: bool = False,
    eps: float = 1e-5,
) -> torch.Tensor:
    """`(x - mean) / (std + eps)` over a flat vector, with independent scopes for mean and std.

    Levels: "batch" (all of x), "group" (elements with the same `groups[i]`), "none" (mean 0 /
    std 1 and no eps). `leave_one_out`: the baseline of element i is `(sum - x_i) / (N - 1)` over
    its mean scope (0 when i is alone in it). The std is the plain std of x within its scope
    (about that scope's mean), with N or, if `unbiased_std`, N - 1 in the denominator (0 when N = 1).
    """
    x = x.double().flatten()
    n = x.numel()
    if n == 0:
        return x.float()
    if mean_level == "none":
        if leave_one_out:
            raise ConfigError("leave_one_out needs a baseline: mean_level must be group or batch")
        baseline = torch.zeros_like(x)
    else:
        sums, counts = _scope_sums(x, _scope(mean_level, n, groups))
        if leave_one_out:
            others = counts - 1
            baseline = torch.where(others > 0, (sums - x) / others.clamp(min=1), torch.zeros_like(x))
        else:
            baseline = sums / counts
    if std_level == "none":
        return (x - baseline).float()
    scope = _scope(std_level, n, groups)
    sums, counts = _scope_sums(x, scope)
    sq, _ = _scope_sums((x - sums / counts).square(), scope)
    denom = counts - 1 if unbiased_std else counts
    std = torch.where(denom > 0, sq / denom.clamp(min=1), torch.zeros_like(x)).sqrt()
    return ((x - baseline) / (std + eps)).float()


def normalize_with(x: torch.Tensor, cfg: AdvantageConfig, groups: torch.Tensor | None = None) -> torch.Tensor:
    return normalize(
        x,
        cfg.mean_level,
        cfg.std_level,
        groups,
        leave_one_out=cfg.leave_one_out,
        unbiased_std=cfg.unbiased_std,
        eps=cfg.eps,
    )


def gae(
    rewards: Sequence[torch.Tensor],
    values: Sequence[torch.Tensor] | None,
    gamma: float = 1.0,
    lam: float = 1.0,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Generalised advantage estimation over each sequence's generated tokens (compressed: no
    prompt or feedback tokens in between), terminal value 0 after the last one.

    `delta_t = r_t + gamma * V_{t+1} - V_t`, `A_t = delta_t + gamma * lam * A_{t+1}`,
    `returns_t = A_t + V_t`. Without values (V = 0) it is the (gamma*lam)-discounted reward-to-go.
    Vectorised over sequences: one step per position of the longest sequence.
    """
    b = len(rewards)
    lengths = [int(r.numel()) for r in rewards]
    width = max(lengths, default=0)
    r_pad = torch.zeros(b, width + 1, dtype=torch.float64)
    v_pad = torch.zeros(b, width + 1, dtype=torch.float64)
    for i, n in enumerate(lengths):
        r_pad[i, :n] = rewards[i].double()
        if values is not None:
            v_pad[i, :n] = values[i].double()
    adv = torch.zeros(b, width + 1, dtype=torch.float64)
    for t in range(width - 1, -1, -1):
        delta = r_pad[:, t] + gamma * v_pad[:, t + 1] - v_pad[:, t]
        adv[:, t] = delta + gamma * lam * adv[:, t + 1]
    # Padding beyond a sequence's end holds r = V = 0, so each sequence's last token sees A = 0
    # and V = 0 after it: the terminal state.
    advantages = [adv[i, :n].float() for i, n in enumerate(lengths)]
    returns = [(adv[i, :n] + v_pad[i, :n]).float() for i, n in enumerate(lengths)]
    return advantages, returns


@dataclass
class AdvantageOutput:
    """Per sequence, input alignment, 0 where the loss mask is 0."""

    advantages: list[torch.Tensor]
    returns: list[torch.Tensor]
    stats: dict[str, float] = field(default_factory=dict)


def compute_advantages(
    loss_masks: Sequence[torch.Tensor],
    rewards: torch.Tensor | Sequence[float],
    cfg: AdvantageConfig,
    *,
    group_ids: GroupIds | None = None,
    values: Sequence[torch.Tensor] | None = None,
    token_rewards: Sequence[torch.Tensor] | None = None,
) -> AdvantageOutput:
    """Advantages and returns for a batch of sequences.

    - `rewards`: one (already shaped) outcome reward per sequence, placed on its last generated token.
    - `token_rewards`: optional per-token rewards added on generated tokens (e.g. `kl_rewards`).
    - Without `values` (GRPO family): the outcome rewards are normalised first (`cfg` levels over
      samples), then GAE with V = 0 spreads them: with gamma = lam = 1 every generated token of a
      sample gets its normalised reward.
    - With `values` (PPO with a critic; `values[i][t]` = V of the state before token t): GAE on
      the raw rewards, then the advantages are normalised over generated tokens (group scope =
      the tokens of the group's samples); `returns = A + V` before normalisation.
    """
    masks = [m.bool().flatten() for m in loss_masks]
    r = torch.as_tensor(rewards, dtype=torch.float32).flatten()
    if r.numel() != len(masks):
        raise ValueError(f"{r.numel()} rewards for {len(masks)} sequences")
    groups = group_index(group_ids) if group_ids is not None else None
    if values is None:
        outcome = normalize_with(r, cfg, groups)
    else:
        outcome = r
    step_rewards = []
    for i, m in enumerate(masks):
        n = int(m.sum())
        tr = torch.zeros(n)
        if token_rewards is not None:
            tr = tr + token_rewards[i].float().flatten()[m]
        if n:
            tr[-1] += outcome[i]
        step_rewards.append(tr)
    step_values = None if values is None else [v.float().flatten()[m] for v, m in zip(values, masks, strict=True)]
    adv_c, ret_c = gae(step_rewards, step_values, cfg.gamma, cfg.lam)
    if values is not None and any(a.numel() for a in adv_c):
        flat = torch.cat(adv_c)
        tok_groups = None
        if groups is not None:
            tok_groups = torch.cat([torch.full((a.numel(),), int(g)) for a, g in zip(adv_c, groups, strict=True)])
        flat = normalize_with(flat, cfg, tok_groups)
        adv_c = list(flat.split([a.numel() for a in adv_c]))
    advantages, returns = [], []
    for m, a, ret in zip(masks, adv_c, ret_c, strict=True):
        full_a, full_r = torch.zeros(m.numel()), torch.zeros(m.numel())
        full_a[m], full_r[m] = a, ret
        advantages.append(full_a)
        returns.append(full_r)
    gen = torch.cat(adv_c) if adv_c else torch.zeros(0)
    stats = {
        "reward_mean": float(r.mean()) if r.numel() else 0.0,
        "reward_std": float(r.std(unbiased=False)) if r.numel() else 0.0,
        "adv_mean": float(gen.mean()) if gen.numel() else 0.0,
        "adv_std": float(gen.std(unbiased=False)) if gen.numel() else 0.0,
        "adv_max": float(gen.max()) if gen.numel() else 0.0,
        "adv_min": float(gen.min()) if gen.numel() else 0.0,
    }
    return AdvantageOutput(advantages, returns, stats)


def add_advantages(
    batch: SequenceBatch,
    cfg: AdvantageConfig,
    *,
    group_ids: GroupIds | None = None,
    rewards: torch.Tensor | Sequence[float] | None = None,
    reward_key: str = "reward",
    values_key: str = "values",
    token_reward_key: str = "kl_rewards",
) -> dict[str, float]:
    """`compute_advantages` on a `SequenceBatch`, in place: writes per-token `advantages` and
    `returns` into every sequence. Rewards come from `rewards` or each sequence's `reward_key`
    scalar; `values_key` / `token_reward_key` are used when the sequences have them."""
    seqs = batch.seqs
    if rewards is None:
        rewards = [float(s[reward_key]) for s in seqs]
    first = seqs[0] if seqs else {}
    values = [s[values_key] for s in seqs] if values_key in first else None
    token_rewards = [s[token_reward_key] for s in seqs] if token_reward_key in first else None
    out = compute_advantages(
        [s[LOSS_MASK] for s in seqs], rewards, cfg, group_ids=group_ids, values=values, token_rewards=token_rewards
    )
    for s, a, ret in zip(seqs, out.advantages, out.returns, strict=True):
        s["advantages"], s["returns"] = a, ret
    return out.stats


@dataclass
class FilterResult:
    keep: torch.Tensor  # [B] bool
    kept_indices: list[int]
    stats: dict[str, Any]


def dynamic_filter(
    rewards: torch.Tensor | Sequence[float], group_ids: GroupIds, atol: float = 1e-6
) -> FilterResult:
    """DAPO dynamic sampling: drop every group whose rewards are all equal (within `atol`); such
    a group has zero group-normalised advantage and only dilutes the batch. A group of one sample
    is dropped too. Stats: groups seen/kept, samples kept, fraction of groups dropped."""
    r = torch.as_tensor(rewards, dtype=torch.float64).flatten()
    groups = group_index(group_ids)
    if groups.numel() != r.numel():
        raise ValueError(f"{groups.numel()} group ids for {r.numel()} rewards")
    k = int(groups.max()) + 1 if groups.numel() else 0
    hi = torch.full((k,), -torch.inf, dtype=torch.float64).scatter_reduce(0, groups, r, "amax")
    lo = torch.full((k,), torch.inf, dtype=torch.float64).scatter_reduce(0, groups, r, "amin")
    group_kept = (hi - lo) > atol
    keep = group_kept[groups]
    kept = keep.nonzero().flatten().tolist()
    n_kept = int(group_kept.sum())
    stats = {
        "n_groups": k,
        "n_groups_kept": n_kept,
        "n_samples_kept": len(kept),
        "frac_groups_filtered": (k - n_kept) / k if k else 0.0,
    }
    return FilterResult(keep, kept, stats)

"""PPO-family losses for `TrainEngine.train_batch`: the decoupled PPO policy loss
(`make_policy_loss` -> `PolicyLoss`) and a clipped value loss (`value_loss`, `ValueLoss`).

The policy loss reads `mb.tokens` in prediction alignment (position t is about token t+1):
`loss_mask`, `logprobs` (behaviour), `advantages`, and `prox_logprobs` (recompute; store them with
`set_prox_logprobs`) or `versions` (loglinear); `ref_logprobs` with `kl_in_loss`. It returns the SUM
over loss tokens: pass `policy_loss_weight` so the engine takes the token mean over the whole batch.
Formulas and statistics: docs/algorithms.md, "The decoupled PPO policy loss"."""

from __future__ import annotations

from collections.abc import MutableMapping, Sequence
from typing import Any

import torch

from tandem.algo.config import PPOConfig
from tandem.algo.rewards import kl_estimate
from tandem.data.batch import LOSS_MASK, MicroBatch, SequenceBatch, count_loss_tokens

BEHAVE_LOGPROBS = "logprobs"
PROX_LOGPROBS = "prox_logprobs"
ADVANTAGES = "advantages"
VERSIONS = "versions"
REF_LOGPROBS = "ref_logprobs"
RETURNS = "returns"
OLD_VALUES = "values"

Stats = MutableMapping[str, Any]


# --------------------------------------------------------------------------------- helpers


def to_input_alignment(next_token_logprobs: torch.Tensor) -> torch.Tensor:
    """`TrainEngine.forward_logprobs` gives `out[t] = log p(token t+1)`; batches store values in
    input alignment (`x[t]` about token t). Shift right by one; token 0 (never predicted) gets 0."""
    out = torch.zeros_like(next_token_logprobs)
    out[1:] = next_token_logprobs[:-1]
    return out


def set_prox_logprobs(
    batch: SequenceBatch, next_token_logprobs: Sequence[torch.Tensor], key: str = PROX_LOGPROBS
) -> None:
    """Store the trainer's recomputed logprobs (`engine.forward_logprobs(batch).logprobs`, batch
    order) in every sequence under `key`, in input alignment, as float32."""
    if len(next_token_logprobs) != len(batch.seqs):
        raise ValueError(f"{len(next_token_logprobs)} logprob tensors for {len(batch.seqs)} sequences")
    for seq, lp in zip(batch.seqs, next_token_logprobs, strict=True):
        seq[key] = to_input_alignment(lp.detach().float().cpu())


def sequence_ids(mb: MicroBatch) -> torch.Tensor:
    """`[T]` index of the sequence each packed token belongs to."""
    lengths = (mb.cu_seqlens[1:] - mb.cu_seqlens[:-1]).long()
    return torch.repeat_interleave(torch.arange(lengths.numel(), device=lengths.device), lengths)


def segment_mean(x: torch.Tensor, mask: torch.Tensor, seq: torch.Tensor, n_seqs: int) -> torch.Tensor:
    """Per-sequence mean of `x` over masked tokens, `[B]` (0 for a sequence with no loss tokens).
    Differentiable in x."""
    sums = torch.zeros(n_seqs, dtype=x.dtype, device=x.device).index_add(0, seq, x * mask)
    counts = torch.zeros(n_seqs, dtype=x.dtype, device=x.device).index_add(0, seq, mask)
    return sums / counts.clamp(min=1)


def loglinear_prox_logprobs(
    logp_theta: torch.Tensor, logp_behave: torch.Tensor, versions: torch.Tensor, version: int
) -> torch.Tensor:
    """Log-linear approximation of the proximal logprobs from token versions (no forward pass).

    `version` is the trainer's weight version during this step: the proximal policy is version
    `v_prox = version` and the policy being optimised moves toward `v_theta = version + 1`. For
    generated tokens (`versions >= 0`) with `v_theta > v_b`:
    `alpha = clamp((v_prox - v_b) / (v_theta - v_b), 0, 1)` and
    `logp_prox = logp_behave + alpha * (logp_theta.detach() - logp_behave)`; elsewhere alpha = 0.
    Tokens sampled by the current weights (v_b = version) get exactly logp_behave.
    """
    v_b = versions.to(torch.float64)
    v_theta, v_prox = float(version + 1), float(version)
    ok = (versions >= 0) & (v_theta > v_b)
    alpha = torch.where(ok, (v_prox - v_b) / (v_theta - v_b).clamp(min=1e-9), torch.zeros_like(v_b))
    alpha = alpha.clamp(0.0, 1.0).to(logp_theta.dtype)
    return logp_behave + alpha * (logp_theta.detach() - logp_behave)


def _add(stats: Stats, key: str, value: torch.Tensor | float) -> None:
    value = value.detach().double() if isinstance(value, torch.Tensor) else float(value)
    stats[key] = stats[key] + value if key in stats else value


def _max(stats: Stats, key: str, value: torch.Tensor) -> None:
    value = value.detach().double()
    stats[key] = torch.maximum(stats[key], value) if key in stats else value


def summarize_stats(stats: Stats) -> dict[str, float]:
    """Turn accumulated stats into numbers: `sum/<name>` / `n_loss_tokens` -> `<name>` (a token
    mean over every micro-batch seen), `cur/<name>` / `n_current_tokens` likewise, `max/<name>` ->
    `<name>`, other keys (the counts) as they are."""
    n = float(stats.get("n_loss_tokens", 0.0))
    n_cur = float(stats.get("n_current_tokens", 0.0))
    out: dict[str, float] = {}
    for key, value in stats.items():
        v = float(value)
        if key.startswith("sum/"):
            out[key[4:]] = v / n if n > 0 else 0.0
        elif key.startswith("cur/"):
            out[key[4:]] = v / n_cur if n_cur > 0 else 0.0
        elif key.startswith("max/"):
            out[key[4:]] = v
        else:
            out[key] = v
    return out


def reduce_stats(stats: Stats, group: Any = None) -> None:
    """All-reduce accumulated stats over a process group, in place (sums for `sum/` keys and
    counts, max for `max/` keys); a no-op without torch.distributed. Every rank must hold the same
    keys (every rank runs the loss on at least one real micro-batch)."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        return
    keys = sorted(stats)
    device = next((v.device for v in stats.values() if isinstance(v, torch.Tensor)), torch.device("cpu"))
    if dist.get_backend(group) == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    maxes = [k for k in keys if k.startswith("max/")]
    sums = [k for k in keys if not k.startswith("max/")]
    for names, op in ((sums, dist.ReduceOp.SUM), (maxes, dist.ReduceOp.MAX)):
        if not names:
            continue
        buf = torch.tensor([float(stats[k]) for k in names], dtype=torch.float64, device=device)
        dist.all_reduce(buf, op=op, group=group)
        for k, v in zip(names, buf.tolist(), strict=True):
            stats[k] = v


# ------------------------------------------------------------------------------ policy loss


class PolicyLoss:
    """The decoupled PPO policy loss as an engine `loss_fn` (picklable; see `make_policy_loss`)."""

    def __init__(self, cfg: PPOConfig, version: int | None = None, stats: Stats | None = None,
                 prox_from_forward: bool = False):
        cfg.check()
        if cfg.prox_logp == "loglinear" and version is None:
            raise ValueError(
                "prox_logp='loglinear' needs the trainer's weight version of this step: "
                "make_policy_loss(cfg, version=...)"
            )
        self.cfg = cfg
        self.version = version
        self.stats = stats
        self.prox_from_forward = prox_from_forward and cfg.prox_logp == "recompute"

    def __call__(self, logprobs: torch.Tensor, entropy: torch.Tensor, mb: MicroBatch) -> torch.Tensor:
        cfg = self.cfg
        tokens = mb.tokens
        for key in (LOSS_MASK, BEHAVE_LOGPROBS, ADVANTAGES):
            if key not in tokens:
                raise KeyError(f"the policy loss needs per-token {key!r} in the batch (have {sorted(tokens)})")
        mask = tokens[LOSS_MASK].to(logprobs.dtype)
        on = mask > 0
        behave = tokens[BEHAVE_LOGPROBS].to(logprobs.dtype)
        adv = tokens[ADVANTAGES].to(logprobs.dtype)
        if self.prox_from_forward:
            # One optimizer step per batch: the weights of this forward ARE the proximal policy.
            prox = logprobs
        elif cfg.prox_logp == "recompute":
            if PROX_LOGPROBS not in tokens:
                raise KeyError(
                    "prox_logp='recompute' needs 'prox_logprobs' in the batch: run "
                    "engine.forward_logprobs(batch) at the start of the step and store them with "
                    "tandem.algo.set_prox_logprobs (or use prox_logp='loglinear')"
                )
            prox = tokens[PROX_LOGPROBS].to(logprobs.dtype)
        else:
            if VERSIONS not in tokens:
                raise KeyError("prox_logp='loglinear' needs per-token 'versions' in the batch")
            prox = loglinear_prox_logprobs(logprobs, behave, tokens[VERSIONS], int(self.version))
        prox = prox.detach()
        seq = sequence_ids(mb)
        n_seqs = len(mb.indices)

        # PPO ratio against the proximal policy (token, or GSPO's per-sequence geometric mean).
        log_ratio_tok = torch.where(on, logprobs - prox, torch.zeros_like(logprobs))
        if cfg.importance_level == "sequence":
            log_ratio = segment_mean(log_ratio_tok, mask, seq, n_seqs)[seq]
            adv = segment_mean(adv, mask, seq, n_seqs)[seq]
        else:
            log_ratio = log_ratio_tok
        ratio = torch.exp(log_ratio)
        clipped = torch.clamp(ratio, 1.0 - cfg.eps_clip, 1.0 + cfg.eps_high)
        pg_unclipped, pg_clipped = -adv * ratio, -adv * clipped
        pg = torch.maximum(pg_unclipped, pg_clipped)
        clip_hit = on & (pg_clipped > pg_unclipped)
        dual_hit = torch.zeros_like(on)
        if cfg.dual_clip is not None:
            bound = cfg.dual_clip * adv.abs()
            dual_hit = on & (adv < 0) & (pg > bound)
            pg = torch.where(adv < 0, torch.minimum(pg, bound), pg)

        # Behaviour correction w = pi_prox / pi_behave (no grad), capped by masking or clamping.
        with torch.no_grad():
            log_w = torch.where(on, prox - behave, torch.zeros_like(prox))
            if cfg.behave_imp_weight_level == "sequence":
                log_w = segment_mean(log_w, mask, seq, n_seqs)[seq]
            w = torch.exp(log_w)
            cap = cfg.behave_imp_weight_cap
            capped = on & (w > cap)
            if cfg.behave_imp_weight_mode == "mask":
                w_eff = torch.where(capped, torch.zeros_like(w), w)
            elif cfg.behave_imp_weight_mode == "clamp":
                w_eff = torch.clamp(w, max=cap)
            else:
                w_eff = torch.ones_like(w)
                capped = torch.zeros_like(on)
        per_token = pg * w_eff * mask
        kl_ref = None
        if cfg.kl_ctl > 0 and cfg.kl_in_loss:
            if REF_LOGPROBS not in tokens:
                raise KeyError("algo.ppo.kl_in_loss needs the reference model's 'ref_logprobs' in the batch")
            kl_ref = kl_estimate(logprobs, tokens[REF_LOGPROBS].to(logprobs.dtype), cfg.kl_estimator)
            per_token = per_token + cfg.kl_ctl * kl_ref * mask
        loss = per_token.sum()

        if self.stats is not None:
            self._record(self.stats, logprobs, entropy, mask, on, behave, adv, log_ratio_tok, ratio, w,
                         clip_hit, dual_hit, capped, loss, tokens.get(VERSIONS))
            if kl_ref is not None:
                _add(self.stats, "sum/kl_ref", (kl_ref.detach() * mask).sum())
        return loss

    def _record(self, stats: Stats, logprobs, entropy, mask, on, behave, adv, log_ratio_tok, ratio, w,
                clip_hit, dual_hit, capped, loss, versions) -> None:
        with torch.no_grad():
            n = mask.sum()
            _add(stats, "n_loss_tokens", n)
            _add(stats, "sum/loss", loss)
            _add(stats, "sum/clip_frac", (clip_hit & on).sum())
            _add(stats, "sum/dual_clip_frac", (dual_hit & on).sum())
            _add(stats, "sum/behave_cap_frac", (capped & on).sum())
            _add(stats, "sum/imp_weight", (w * mask).sum())
            _add(stats, "sum/ratio", (ratio * mask).sum())
            _add(stats, "sum/advantage", (adv * mask).sum())
            # k3 estimate of KL(pi_prox || pi_theta) on tokens sampled (about) from pi_prox.
            r_tok = torch.exp(log_ratio_tok)
            _add(stats, "sum/approx_kl", ((r_tok - 1 - log_ratio_tok) * mask).sum())
            # k3 estimate of KL(pi_behave || pi_prox): how far the samples are off-policy.
            log_w_tok = torch.log(w.clamp(min=1e-30))
            _add(stats, "sum/behave_approx_kl", ((w - 1 - log_w_tok) * mask).sum())
            _add(stats, "sum/entropy", (entropy.detach() * mask).sum())
            neg_inf = torch.full_like(w, -torch.inf)
            _max(stats, "max/imp_weight_max", torch.where(on, w, neg_inf).max())
            _max(stats, "max/ratio_max", torch.where(on, ratio.detach(), neg_inf).max())
            if self.prox_from_forward:  # logprobs are pi_prox here: the train/inference mismatch
                diff_all = torch.where(on, (logprobs.detach() - behave).abs(), torch.zeros_like(behave))
                _add(stats, "sum/prox_behave_absdiff", diff_all.sum())
                _max(stats, "max/prox_behave_absdiff_max", diff_all.max())
            # |logp_theta - logp_behave| on tokens sampled by the current weights: equals the
            # train / inference mismatch on the first minibatch of a step (before any update).
            if self.version is not None and versions is not None:
                cur = on & (versions == self.version)
                diff = torch.where(cur, (logprobs.detach() - behave).abs(), torch.zeros_like(behave))
                _add(stats, "n_current_tokens", cur.sum())
                _add(stats, "cur/theta_behave_absdiff", diff.sum())
                _max(stats, "max/theta_behave_absdiff_max", diff.max())


def make_policy_loss(cfg: PPOConfig, *, version: int | None = None, stats: Stats | None = None,
                     prox_from_forward: bool = False) -> PolicyLoss:
    """The decoupled PPO policy loss for `engine.train_batch(batch, loss_fn, policy_loss_weight)`.

    `version`: the trainer's weight version during this step (needed by `prox_logp="loglinear"`).
    `stats`: a dict the loss adds per-micro-batch sums to (`n_loss_tokens`, `sum/<name>`,
    `max/<name>`); `summarize_stats` turns it into means, `reduce_stats` combines DP ranks.
    `prox_from_forward`: with `prox_logp="recompute"` and ONE optimizer step on the batch, the
    proximal logprobs are the (detached) logprobs of the training forward itself, which runs the
    proximal weights: exact, and it saves the separate forward pass. Wrong with several minibatches
    (after the first step the weights are no longer the proximal ones), so callers enable it only then.
    """
    return PolicyLoss(cfg, version=version, stats=stats, prox_from_forward=prox_from_forward)


def policy_loss_weight(mb: MicroBatch) -> torch.Tensor:
    """Loss-token count: with it the engine's normaliser is the global number of loss tokens
    (tokens masked by the behaviour cap still count, with zero loss)."""
    return count_loss_tokens(mb)


# ------------------------------------------------------------------------------- value loss


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    eps_clip: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Clipped value loss summed over masked tokens, and the number of tokens where the clipped
    branch was taken: `V_clip = V_old + clip(V - V_old, -eps, eps)`,
    `loss_t = max((V - R)^2, (V_clip - R)^2) / 2`."""
    mask = mask.to(values.dtype)
    v_clip = old_values + torch.clamp(values - old_values, -eps_clip, eps_clip)
    plain, clipped = (values - returns).square(), (v_clip - returns).square()
    per_token = torch.maximum(plain, clipped) / 2
    return (per_token * mask).sum(), ((clipped > plain).to(values.dtype) * mask).sum().detach()


class ValueLoss:
    """Value loss over a micro-batch for a critic whose forward yields `values [T]` in prediction
    alignment (`values[t]` = V of the state before token t+1). Reads `values` (the old estimates)
    and `returns` from `mb.tokens`; returns the sum over loss tokens (normalise with
    `policy_loss_weight`)."""

    def __init__(self, cfg: PPOConfig, stats: Stats | None = None):
        self.eps_clip = cfg.value_eps_clip
        self.stats = stats

    def __call__(self, values: torch.Tensor, mb: MicroBatch) -> torch.Tensor:
        mask = mb.tokens[LOSS_MASK]
        loss, n_clipped = value_loss(values, mb.tokens[OLD_VALUES].to(values.dtype),
                                     mb.tokens[RETURNS].to(values.dtype), mask, self.eps_clip)
        if self.stats is not None:
            _add(self.stats, "n_loss_tokens", mask.sum())
            _add(self.stats, "sum/value_loss", loss)
            _add(self.stats, "sum/value_clip_frac", n_clipped)
        return loss

"""Train/inference logprob mismatch: `|logp_recomputed - logp_behave|` of the sampled tokens
(`logprob_mismatch`, `batch_logprob_mismatch`), over all loss tokens (`mismatch/{mean,max,n_tokens}`)
and over tokens of the current weight version (`mismatch/current_*`: numerics only, ~0 in float32;
a jump there is a bug signal). Log it every step; see docs/algorithms.md, "Train/inference mismatch"."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tandem.algo.losses import BEHAVE_LOGPROBS, PROX_LOGPROBS, VERSIONS
from tandem.data.batch import LOSS_MASK, SequenceBatch

Tensors = torch.Tensor | Sequence[torch.Tensor]


def _flat(x: Tensors) -> torch.Tensor:
    if isinstance(x, torch.Tensor):
        return x.flatten()
    return torch.cat([t.flatten() for t in x]) if len(x) else torch.zeros(0)


def logprob_mismatch(
    recomputed: Tensors,
    behave: Tensors,
    loss_mask: Tensors,
    versions: Tensors | None = None,
    current_version: int | None = None,
) -> dict[str, float]:
    """Mean and max |recomputed - behave| over loss tokens, overall and on tokens with
    `versions == current_version`. All inputs share one alignment (flat `[T]` tensors or lists of
    per-sequence tensors). Returns `mismatch/{mean,max,n_tokens}` and, with versions,
    `mismatch/{current_mean,current_max,current_n_tokens}` (0 when a scope is empty)."""
    rec, beh = _flat(recomputed).double(), _flat(behave).double()
    mask = _flat(loss_mask).bool()
    diff = (rec - beh).abs()
    out = _summary(diff[mask], "")
    if versions is not None and current_version is not None:
        cur = mask & (_flat(versions) == current_version)
        out.update(_summary(diff[cur], "current_"))
    return out


def _summary(d: torch.Tensor, prefix: str) -> dict[str, float]:
    n = d.numel()
    return {
        f"mismatch/{prefix}mean": float(d.mean()) if n else 0.0,
        f"mismatch/{prefix}max": float(d.max()) if n else 0.0,
        f"mismatch/{prefix}n_tokens": float(n),
    }


def batch_logprob_mismatch(
    batch: SequenceBatch, current_version: int | None = None, recomputed_key: str = PROX_LOGPROBS
) -> dict[str, float]:
    """`logprob_mismatch` on a batch after `set_prox_logprobs` (both sides in input alignment)."""
    seqs = batch.seqs
    has_versions = bool(seqs) and VERSIONS in seqs[0]
    return logprob_mismatch(
        [s[recomputed_key] for s in seqs],
        [s[BEHAVE_LOGPROBS] for s in seqs],
        [s[LOSS_MASK] for s in seqs],
        [s[VERSIONS] for s in seqs] if has_versions else None,
        current_version,
    )

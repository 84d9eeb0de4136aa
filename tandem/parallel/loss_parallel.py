"""Log-probabilities and entropy from vocabulary-sharded logits, without gathering them.

Each TP rank holds the logits of its slice `[start, start + V_local)` of the vocabulary. Per token:
  m       = max over ranks of the local max logit           (all-reduce MAX; a constant shift)
  S       = sum over ranks of sum_v exp(z_v - m)            \
  Z1      = sum over ranks of sum_v exp(z_v - m) * (z_v - m) } one all-reduce SUM of three values
  z_label = the label's logit, from the rank that holds it  /
  log p(label) = z_label - (m + log S),   entropy = log S - Z1 / S
(the entropy from shifted logits: no cancellation between two terms of the logits' magnitude).
The sums are differentiable with an identity backward (`sum_forward_only`): every TP rank computes
the same loss from them, so each receives exactly its slice's gradient; the head's input gradient
is then summed by the head's own tensor-parallel backward.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from tandem.parallel.tensor_parallel import max_over, sum_forward_only


def vocab_parallel_logprobs_entropy(
    local_logits: torch.Tensor,
    labels: torch.Tensor,
    vocab_start: int,
    group: dist.ProcessGroup,
    temperature: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 `(log p(labels), entropy)`, `[N]` each, of softmax(logits / temperature) where the
    full logits are the concatenation over `group`'s ranks (in rank order) of `local_logits`
    `[N, V_local]`, this rank's columns starting at global id `vocab_start`. `labels` `[N]` are
    global ids, the same on every rank. Collective: two all-reduces. Every rank must hold at least
    one vocabulary column."""
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    z = local_logits.float()
    if temperature != 1.0:
        z = z / temperature
    n_local = z.shape[-1]
    m = max_over(z.max(dim=-1).values, group)  # no gradient needed: log-sum-exp does not depend on it
    shifted = z - m[:, None]
    e = torch.exp(shifted)
    local_ids = labels - vocab_start
    mine = (local_ids >= 0) & (local_ids < n_local)
    label_logit = z.gather(-1, local_ids.clamp(0, n_local - 1)[:, None]).squeeze(-1)
    label_logit = torch.where(mine, label_logit, torch.zeros_like(label_logit))
    sums = sum_forward_only(torch.stack([e.sum(-1), (e * shifted).sum(-1), label_logit]), group)
    s, z1, z_label = sums.unbind(0)
    log_s = torch.log(s)
    return z_label - (m + log_s), log_s - z1 / s

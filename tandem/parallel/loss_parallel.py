"""Log-probabilities and entropy from vocabulary-sharded logits, without gathering them
(`vocab_parallel_logprobs_entropy`; each TP rank holds the logits of its vocabulary slice).

Per token, with `m` the all-reduced max logit and one all-reduce SUM of `S = sum exp(z - m)`,
`Z1 = sum exp(z - m) (z - m)` and the label's logit: `log p = z_label - (m + log S)`,
`entropy = log S - Z1 / S` (from shifted logits: no cancellation of two large terms). The sums pass
their gradient straight through (every TP rank computes the same loss), so each rank receives
exactly its slice's gradient."""

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

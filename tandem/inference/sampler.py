"""Token sampling for one step: penalties, min_new_tokens, temperature/greedy, top-k, top-p.

Returned logprob: for the sampled token t, `log_softmax(logits / T)[t]` in float32, where `logits`
are the model's raw logits and T the request's temperature (T = 1 for greedy). It is taken BEFORE
penalties, min_new_tokens masking and top-k/top-p filtering, so it is exactly the quantity the
trainer recomputes from the same weights (a filtered distribution would put -inf on tokens the
trainer's model gives mass to).

Sampling order: penalties (over the output so far) -> mask stop tokens until min_new_tokens ->
greedy argmax, or divide by T -> top-k -> top-p over what top-k left -> draw. Draws use the
exponential race (argmax p / E with E ~ Exp(1)), with noise from each sequence's own generator, so
a seeded request draws the same tokens whatever else shares its batch.
"""

from __future__ import annotations

import torch

from tandem.inference.sequence import Sequence


def stop_ids(seq: Sequence, eos_ids: frozenset[int]) -> list[int]:
    """Tokens that would end `seq` (and so are masked while min_new_tokens is not reached)."""
    ids = set(seq.params.stop_token_ids)
    if not seq.params.ignore_eos:
        ids |= eos_ids
    return sorted(ids)


def _apply_penalties(logits: torch.Tensor, seqs: list[Sequence], eos_ids: frozenset[int]) -> None:
    vocab = logits.shape[1]
    for row, seq in enumerate(seqs):
        p = seq.params
        if (p.frequency_penalty or p.presence_penalty) and seq.num_output_tokens:
            out = torch.tensor(seq.output_ids, device=logits.device)
            counts = torch.bincount(out, minlength=vocab)[:vocab].to(logits.dtype)
            logits[row] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)
        if seq.num_output_tokens < p.min_new_tokens and (masked := stop_ids(seq, eos_ids)):
            logits[row, [t for t in masked if t < vocab]] = float("-inf")


def _top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Keep each row's top_k largest logits, then the smallest head of those whose probability mass
    reaches top_p (the most likely token always stays); the rest become -inf."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    rank = torch.arange(logits.shape[1], device=logits.device)
    drop = rank[None, :] >= top_k[:, None]
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    sorted_logits = sorted_logits.masked_fill(mass_before >= top_p[:, None], float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)


@torch.inference_mode()
def sample(logits: torch.Tensor, seqs: list[Sequence], eos_ids: frozenset[int]) -> tuple[list[int], list[float]]:
    """logits `[B, V]` float32 (row i for seqs[i]) -> (token ids, their logprobs)."""
    logits = logits.float()
    vocab, device = logits.shape[1], logits.device
    greedy = torch.tensor([s.params.greedy for s in seqs], device=device)
    temps = torch.tensor([1.0 if s.params.greedy else s.params.temperature for s in seqs],
                         dtype=torch.float32, device=device)[:, None]
    logprobs_all = torch.log_softmax(logits / temps, dim=-1)

    processed = logits.clone()
    _apply_penalties(processed, seqs, eos_ids)
    tokens = processed.argmax(dim=-1)
    if not bool(greedy.all()):
        scaled = processed / temps
        top_k = torch.tensor([s.params.vocab_top_k or vocab for s in seqs], device=device)
        top_p = torch.tensor([s.params.top_p for s in seqs], dtype=torch.float32, device=device)
        if bool((top_k < vocab).any() or (top_p < 1.0).any()):
            scaled = _top_k_top_p(scaled, top_k, top_p)
        probs = scaled.softmax(dim=-1)
        noise = torch.stack([
            torch.empty(vocab, device=device).exponential_(generator=s.generator) if not s.params.greedy
            else torch.ones(vocab, device=device)
            for s in seqs
        ])
        drawn = (probs / noise).argmax(dim=-1)
        tokens = torch.where(greedy, tokens, drawn)
    chosen = logprobs_all.gather(1, tokens[:, None])[:, 0]
    return tokens.tolist(), chosen.tolist()

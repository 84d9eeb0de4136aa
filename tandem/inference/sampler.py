"""Token sampling for one step: penalties, min_new_tokens, temperature/greedy, top-k, top-p, min-p.

Returned logprob: for the sampled token t, `log_softmax(logits / T)[t]` in float32, where `logits`
are the model's raw logits and T the request's temperature (T = 1 for greedy), taken BEFORE
penalties, min_new_tokens masking and any filtering: exactly what the trainer recomputes. A draw
uses one uniform from the sequence's own generator, so a seeded request draws the same tokens
whatever shares its batch. The order and the draw: docs/inference.md, "Sampling and logprobs"."""

from __future__ import annotations

import torch

from tandem.inference import cpu_kernels
from tandem.inference.sampling_params import SamplingParams
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
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(seq.token_ids)), device=logits.device)
            seen = seen[seen < vocab]
            picked = logits[row, seen]
            logits[row, seen] = torch.where(picked > 0, picked / p.repetition_penalty, picked * p.repetition_penalty)
        if (p.frequency_penalty or p.presence_penalty) and seq.num_output_tokens:
            out = torch.tensor(seq.output_ids, device=logits.device)
            counts = torch.bincount(out, minlength=vocab)[:vocab].to(logits.dtype)
            logits[row] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)
        if seq.num_output_tokens < p.min_new_tokens and (masked := stop_ids(seq, eos_ids)):
            logits[row, [t for t in masked if t < vocab]] = float("-inf")


def _top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                 min_p: torch.Tensor | None = None) -> torch.Tensor:
    """Keep each row's top_k largest logits, then the smallest head of those whose probability mass
    reaches top_p (the most likely token always stays), then (with min_p) those whose probability
    is at least min_p times the most likely one's; the rest become -inf."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    rank = torch.arange(logits.shape[1], device=logits.device)
    drop = rank[None, :] >= top_k[:, None]
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    sorted_logits = sorted_logits.masked_fill(mass_before >= top_p[:, None], float("-inf"))
    if min_p is not None:  # p_i < min_p * p_max  <=>  l_i < l_max + log(min_p)
        floor = sorted_logits[:, :1] + torch.log(min_p)[:, None]
        sorted_logits = sorted_logits.masked_fill(sorted_logits < floor, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)


def _needs_processing(seq: Sequence) -> bool:
    p = seq.params
    return bool((p.frequency_penalty or p.presence_penalty) and seq.num_output_tokens) or (
        seq.num_output_tokens < p.min_new_tokens) or p.repetition_penalty != 1.0


DRAW_WIDTH = 64  # tokens per block of the two-level draw


def _draw(scaled: torch.Tensor, uniforms: torch.Tensor, width: int = DRAW_WIDTH) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse-CDF draw of one token per row of `scaled` (logits / T, -inf where filtered).

    -> (tokens, log of each row's normaliser: max + log(sum exp(scaled - max))). Two levels, so no
    full-width cumulative sum: sums of `width`-token blocks (their running sum in float64) locate
    the block holding the uniform's mass, then a running sum inside that block locates the token.
    A token with zero probability is never returned (each search finds the first running sum
    strictly above the target, and targets stay strictly below the total).
    """
    rows, vocab = scaled.shape
    top = scaled.amax(-1, keepdim=True)
    e = (scaled - top).exp_()
    if vocab % width:
        e = torch.nn.functional.pad(e, (0, width - vocab % width))
    blocks = e.view(rows, -1, width)
    cdf = blocks.sum(-1, dtype=torch.float64).cumsum_(-1)  # [B, nb]
    total = cdf[:, -1:]
    target = torch.minimum(uniforms[:, None] * total, torch.nextafter(total, torch.zeros_like(total)))
    blk = torch.searchsorted(cdf, target, right=True).clamp_(max=cdf.shape[1] - 1)  # [B, 1]
    before = torch.where(blk > 0, cdf.gather(1, (blk - 1).clamp_(min=0)), 0.0)
    inner = blocks.gather(1, blk[:, :, None].expand(rows, 1, width))[:, 0].to(torch.float64).cumsum_(-1)
    rest = torch.minimum(target - before, torch.nextafter(inner[:, -1:], torch.zeros_like(total)))
    j = torch.searchsorted(inner, rest, right=True).clamp_(max=width - 1)
    return (blk * width + j)[:, 0], top[:, 0] + total[:, 0].log().to(top.dtype)


def draw(scaled: torch.Tensor, uniforms: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`_draw`'s contract, in one C++ pass per row on CPU where the kernel is built
    (`csrc/sampler.cpp`: the same search, exponentials and sums rounded differently), else `_draw`."""
    kernel = cpu_kernels.sampler() if scaled.device.type == "cpu" else None
    if kernel is None:
        return _draw(scaled, uniforms)
    tokens, norm = kernel.draw(scaled.float().contiguous(), uniforms.to(torch.float64), DRAW_WIDTH)
    return tokens, norm


@torch.inference_mode()
def sample(logits: torch.Tensor, seqs: list[Sequence], eos_ids: frozenset[int]) -> tuple[list[int], list[float]]:
    """logits `[B, V]` float32 (row i for seqs[i]) -> (token ids, their logprobs)."""
    logits = logits.float()
    vocab, device = logits.shape[1], logits.device
    params = [s.params for s in seqs]
    greedy = [p.greedy for p in params]
    temps = [1.0 if g else p.temperature for p, g in zip(params, greedy, strict=True)]
    raw = logits if all(t == 1.0 for t in temps) else logits / torch.tensor(temps, device=device)[:, None]
    processed = logits
    if any(_needs_processing(s) for s in seqs):
        processed = logits.clone()
        _apply_penalties(processed, seqs, eos_ids)
    lse = None  # log normaliser of `raw` (the logprob's distribution)
    if all(greedy):
        tokens = processed.argmax(dim=-1)
    else:
        scaled = raw if processed is logits else processed / torch.tensor(temps, device=device)[:, None]
        top_k = [min(p.vocab_top_k or vocab, vocab) for p in params]  # more than the vocabulary: all of it
        top_p = [p.top_p for p in params]
        min_p = [p.min_p for p in params]
        filtered = any(k < vocab for k in top_k) or any(p < 1.0 for p in top_p) or any(min_p)
        if filtered:
            scaled = _top_k_top_p(scaled, torch.tensor(top_k, device=device),
                                  torch.tensor(top_p, dtype=torch.float32, device=device),
                                  torch.tensor(min_p, dtype=torch.float32, device=device) if any(min_p) else None)
        # One uniform per sampled sequence from its own generator: draws do not depend on the batch.
        uniforms = torch.cat([
            torch.ones(1, dtype=torch.float64, device=device) / 2 if g
            else torch.rand(1, dtype=torch.float64, device=device, generator=s.generator)
            for s, g in zip(seqs, greedy, strict=True)
        ])
        tokens, norm = draw(scaled, uniforms)
        if scaled is raw:
            lse = norm  # the sampling distribution is the logprob's: reuse its normaliser
        if any(greedy):
            tokens = torch.where(torch.tensor(greedy, device=device), processed.argmax(dim=-1), tokens)
            lse = None
    if lse is None:
        lse = torch.logsumexp(raw, dim=-1)
    chosen = raw.gather(1, tokens[:, None])[:, 0] - lse
    return tokens.tolist(), chosen.tolist()


@torch.inference_mode()
def top_logprobs(logits: torch.Tensor, temperatures: list[float], nums: list[int]) -> list[list[tuple[float, int]]]:
    """The `nums[i]` most likely tokens of row i under the logprob's distribution (module docstring:
    `log_softmax(logits / T)` in float32, T = 1 for greedy), as `(logprob, token id)` pairs, most
    likely first (ties: lower id first). Rows with num 0 get []."""
    out: list[list[tuple[float, int]]] = []
    for row, (temp, num) in enumerate(zip(temperatures, nums, strict=True)):
        if num <= 0:
            out.append([])
            continue
        lp = torch.log_softmax(logits[row].float() / temp, dim=-1)
        num = min(num, lp.shape[0])
        order = torch.sort(lp, descending=True, stable=True).indices[:num]
        out.append(list(zip(lp[order].tolist(), order.tolist(), strict=True)))
    return out


def logprob_temperature(params: SamplingParams) -> float:
    """T of the logprob's distribution for these sampling params (1 for greedy)."""
    return 1.0 if params.greedy else float(params.temperature)

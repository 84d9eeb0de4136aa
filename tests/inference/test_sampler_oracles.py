"""The sampler's filtered distribution checked against oracles that are not the sampler: transformers'
logits processors (temperature, top-k, top-p, min-p, repetition penalty, min_new_tokens) and
hand-worked logits (the filters, frequency and presence penalties, min_new_tokens through the engine).

What is compared is the distribution `sample` draws from (the softmax of what it hands its draw,
captured by a spy on `draw`), so every step `sample` takes before the draw is covered, not a
helper called on its own; no random draws are compared.
"""

from __future__ import annotations

import math

import pytest
import torch
from transformers import MinNewTokensLengthLogitsProcessor

from tandem.inference import sampler
from tandem.inference.engine import LLMEngine
from tandem.inference.sampling_params import SamplingParams
from tandem.inference.sequence import Sequence
from tests.inference.conftest import prompts
from tests.inference.hf_sampling import hf_filtered_probs


def drawn_from(monkeypatch, logits: torch.Tensor, seqs: list[Sequence],
               eos_ids: frozenset[int] = frozenset()) -> tuple[torch.Tensor, list[int], list[float]]:
    """Run `sample` and return the logits it drew each row from (`draw`'s input: logits after
    penalties, masking, temperature and filtering), with its tokens and logprobs."""
    seen: list[torch.Tensor] = []
    real = sampler.draw

    def spy(scaled, uniforms, *args, **kwargs):
        seen.append(scaled.clone())
        return real(scaled, uniforms, *args, **kwargs)

    monkeypatch.setattr(sampler, "draw", spy)
    tokens, logprobs = sampler.sample(logits.clone(), seqs, eos_ids)
    assert len(seen) == 1, "sample drew more or less than once"
    return seen[0], tokens, logprobs


def _seq(params: SamplingParams, prompt: list[int] = (1, 2, 3), output: list[int] = (), seed: int = 0) -> Sequence:
    seq = Sequence("r", list(prompt), params, torch.Generator().manual_seed(seed))
    for t in output:
        seq.append(t, 0.0)
    return seq


FILTERS = [
    {"temperature": 0.7, "top_k": 20},
    {"temperature": 1.3, "top_p": 0.8},
    {"temperature": 0.9, "top_p": 0.95, "min_p": 0.1},
    {"temperature": 1.0, "min_p": 0.05},
    {"temperature": 0.6, "top_k": 50, "top_p": 0.9, "min_p": 0.02},
    {"temperature": 1.0, "top_k": 1},
    {"temperature": 1.0, "top_p": 0.05},
    {"temperature": 1.1},  # unfiltered, in a batch where the other rows filter
    {"temperature": 0.8, "top_k": 40, "repetition_penalty": 1.4},
]


def test_each_rows_filtered_distribution_equals_transformers_warpers(monkeypatch):
    """Catches a top-k, top-p or min-p cut in the wrong place (one token too many or too few), top-p
    taken over the whole vocabulary instead of what top-k left, min-p relative to the wrong
    probability, temperature applied after the filters, and a row's filter applied to another row of
    the batch: every row's kept tokens and renormalised probabilities equal transformers'."""
    vocab = 300
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(len(FILTERS), vocab, generator=gen) * 3  # peaked: top-p and min-p cut deep
    seqs = [_seq(SamplingParams(**kw), prompt=[7, 8, 9, 120], output=[120, 33], seed=i)
            for i, kw in enumerate(FILTERS)]
    scaled, tokens, _ = drawn_from(monkeypatch, logits, seqs)
    ours = scaled.double().softmax(-1)
    for row, (kw, seq) in enumerate(zip(FILTERS, seqs, strict=True)):
        theirs = hf_filtered_probs(logits[row], seq.params, seq.token_ids)
        kept, hf_kept = (ours[row] > 0).nonzero()[:, 0].tolist(), (theirs > 0).nonzero()[:, 0].tolist()
        assert kept == hf_kept, f"{kw}: tandem keeps {len(kept)} tokens, transformers {len(hf_kept)}"
        assert (ours[row] - theirs).abs().max() < 1e-6, kw
        assert theirs[tokens[row]] > 0, f"{kw}: drew a token transformers filters out"
    # The configurations reach both ends: some rows keep a handful of tokens, one keeps them all.
    sizes = [int((ours[r] > 0).sum()) for r in range(len(FILTERS))]
    assert min(sizes) == 1 and max(sizes) == vocab and len(set(sizes)) >= 6, sizes


# Probabilities 0.05, 0.4, 0.1, 0.3, 0.15 (token 1 the most likely, then 3, 4, 2, 0).
HAND = torch.tensor([0.05, 0.4, 0.1, 0.3, 0.15]).log()
SEVENTHS = {1: 4 / 7, 3: 3 / 7}
TOP3 = {1: 0.4 / 0.85, 3: 0.3 / 0.85, 4: 0.15 / 0.85}
_W = {t: math.sqrt(p) for t, p in ((1, 0.4), (3, 0.3), (4, 0.15))}  # temperature 2: p ** (1 / 2)


@pytest.mark.parametrize(("kw", "expected"), [
    ({"top_k": 2}, SEVENTHS),
    ({"top_p": 0.65}, SEVENTHS),  # 0.4 < 0.65 before token 3; 0.7 >= 0.65 before token 4
    ({"top_p": 0.75}, TOP3),  # 0.7 < 0.75 before token 4: it stays
    # top-p over what top-k left: (0.4, 0.3, 0.15) / 0.85 has 0.82 >= 0.8 before token 4, so it goes
    # (over the whole vocabulary 0.7 < 0.8 would keep it).
    ({"top_k": 3, "top_p": 0.8}, SEVENTHS),
    ({"min_p": 0.3}, TOP3),  # floor 0.12: 0.15 stays, 0.1 goes
    ({"min_p": 0.5}, SEVENTHS),  # floor 0.2
    ({"temperature": 0.5, "top_k": 2}, {1: 0.16 / 0.25, 3: 0.09 / 0.25}),  # p ** 2: 0.16, 0.09
    ({"temperature": 2.0, "min_p": 0.55}, {t: w / sum(_W.values()) for t, w in _W.items()}),  # floor 0.348
])
def test_hand_worked_filters(monkeypatch, kw, expected):
    """Catches the same cuts as the transformers comparison on a case worked by hand (the kept set
    and renormalised probabilities written down), in particular top-p applied to the whole
    vocabulary rather than to what top-k left, and a cut that keeps one token too few."""
    params = SamplingParams(**kw)
    scaled, _, _ = drawn_from(monkeypatch, HAND[None], [_seq(params)])
    probs = scaled[0].double().softmax(-1)
    want = torch.zeros(5, dtype=torch.float64)
    for token, p in expected.items():
        want[token] = p
    assert (probs > 0).nonzero()[:, 0].tolist() == sorted(expected), (kw, probs)
    assert (probs - want).abs().max() < 1e-6, (kw, probs)
    assert (hf_filtered_probs(HAND, params, [1, 2, 3]) - want).abs().max() < 1e-6, kw  # transformers agrees


def test_frequency_and_presence_penalties_hand_computed(monkeypatch):
    """Catches penalties that count the prompt (OpenAI's count only output tokens), presence charged
    per occurrence instead of once, a sign error, penalties applied after temperature instead of
    before it, penalties leaking into another row, and a returned logprob that is penalised."""
    vocab = 10
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, vocab, generator=gen)
    prompt, output = [1, 2, 3, 5], [5, 5, 7, 3, 5]  # output counts: 5 x3, 7 x1, 3 x1; 1 and 2 only in the prompt
    params = [SamplingParams(temperature=0.5, frequency_penalty=0.5, presence_penalty=0.25),
              SamplingParams(temperature=0.5, frequency_penalty=-0.4, presence_penalty=1.5),
              SamplingParams(temperature=0.5)]
    seqs = [_seq(p, prompt, output, seed=i) for i, p in enumerate(params)]
    scaled, tokens, logprobs = drawn_from(monkeypatch, logits, seqs)
    want = logits.clone()
    # row 0: token 5: 3 * 0.5 + 0.25 = 1.75; tokens 7 and 3: 1 * 0.5 + 0.25 = 0.75
    want[0, 5] -= 1.75
    want[0, 7] -= 0.75
    want[0, 3] -= 0.75
    # row 1: token 5: 3 * -0.4 + 1.5 = 0.3; tokens 7 and 3: -0.4 + 1.5 = 1.1
    want[1, 5] -= 0.3
    want[1, 7] -= 1.1
    want[1, 3] -= 1.1
    want /= 0.5  # temperature after the penalties; row 2 has none
    off = (scaled - want).abs()
    assert off.max() < 1e-5, (f"largest |tandem - hand-computed| per row {off.amax(-1).tolist()} "
                              f"at tokens {off.argmax(-1).tolist()}")
    raw = torch.log_softmax(logits / 0.5, -1)
    assert max(abs(lp - float(raw[r, t])) for r, (t, lp) in enumerate(zip(tokens, logprobs, strict=True))) < 1e-6


def test_min_new_tokens_masks_stop_tokens_as_transformers_does(monkeypatch):
    """Catches min_new_tokens counted over prompt + output (transformers skips the prompt), off by one
    at the boundary, or masking only EOS and not the request's stop_token_ids (or the reverse): the
    masked set equals what MinNewTokensLengthLogitsProcessor masks for every output length."""
    vocab, eos, stop = 12, frozenset({2, 9}), [4]
    logits = torch.randn(1, vocab, generator=torch.Generator().manual_seed(1))
    prompt = [5, 6, 7]
    for done in range(5):
        params = SamplingParams(min_new_tokens=3, stop_token_ids=stop)
        seq = _seq(params, prompt, [8] * done)
        scaled, _, _ = drawn_from(monkeypatch, logits, [seq], eos)
        oracle = MinNewTokensLengthLogitsProcessor(len(prompt), 3, sorted(eos | set(stop)))
        theirs = oracle(torch.tensor([seq.token_ids]), logits.clone())
        masked, hf_masked = scaled[0].isinf().nonzero()[:, 0].tolist(), theirs[0].isinf().nonzero()[:, 0].tolist()
        assert masked == hf_masked, f"after {done} output tokens tandem masks {masked}, transformers {hf_masked}"
        assert bool(scaled[0, [2, 9, 4]].isinf().all()) == (done < 3), done


def test_min_new_tokens_gives_eos_zero_probability_through_the_engine(monkeypatch, qwen3_dir):
    """Catches the engine or sampler letting an EOS token be drawn before min_new_tokens (or masking
    it after): with EOS made almost the whole vocabulary, every distribution the engine samples the
    first 4 tokens from gives EOS probability exactly 0, the 5th's gives it most of the mass, and no
    sample holds EOS in its first 4 tokens."""
    engine = LLMEngine(qwen3_dir, kv_cache_tokens=512, block_size=8, max_num_seqs=8)
    allowed = set(range(20, 30))
    engine.eos_ids = frozenset(range(engine.vocab_size)) - allowed
    steps: list[tuple[list[int], torch.Tensor]] = []  # (output lengths of the batch's rows, their logits)
    real_sample, real_draw = sampler.sample, sampler.draw

    def sample_spy(logits, seqs, eos_ids):
        steps.append(([s.num_output_tokens for s in seqs], None))
        return real_sample(logits, seqs, eos_ids)

    def draw_spy(scaled, uniforms, *args, **kwargs):
        steps[-1] = (steps[-1][0], scaled.clone())
        return real_draw(scaled, uniforms, *args, **kwargs)

    monkeypatch.setattr("tandem.inference.engine.sample", sample_spy)
    monkeypatch.setattr(sampler, "draw", draw_spy)
    params = SamplingParams(max_new_tokens=8, min_new_tokens=4, temperature=1.0, n=4, seed=3)
    outs = engine.generate(prompts([9], seed=4), params)
    eos = torch.tensor(sorted(engine.eos_ids))
    seen = {}
    for lengths, scaled in steps:
        eos_mass = scaled.double().softmax(-1)[:, eos].sum(-1)
        for n, mass in zip(lengths, eos_mass.tolist(), strict=True):
            seen.setdefault(n, []).append(mass)
    for n in range(4):
        assert seen.get(n) and all(m == 0.0 for m in seen[n]), f"EOS probability after {n} tokens: {seen.get(n)}"
    assert sorted(seen) == [0, 1, 2, 3, 4], seen  # everyone stopped right after the minimum
    assert all(m > 0.9 for m in seen[4]), seen[4]  # unmasked, EOS holds nearly all the mass
    assert len(outs) == 4
    for out in outs:
        assert not set(out.output_ids[:4]) & engine.eos_ids, out.output_ids
        assert out.finish_reason["type"] == "stop" and out.completion_tokens == 5, out

"""The batched sampler draws from the filtered distribution and returns the unfiltered logprob."""

from __future__ import annotations

import pytest
import torch

from tandem.inference.sampler import _top_k_top_p, sample
from tandem.inference.sampling_params import SamplingParams
from tandem.inference.sequence import Sequence


def _seqs(n: int, params: SamplingParams) -> list[Sequence]:
    return [Sequence(f"r{i}", [1, 2, 3], params, torch.Generator().manual_seed(1000 + i)) for i in range(n)]


@pytest.mark.parametrize("vocab", [200, 64])  # 200: not a multiple of the 64-token blocks
@pytest.mark.parametrize("kw", [{}, {"temperature": 0.7, "top_k": 20}, {"temperature": 1.3, "top_p": 0.8}])
def test_draws_follow_the_filtered_distribution(vocab, kw):
    torch.manual_seed(0)
    row = torch.randn(vocab) * 2
    params = SamplingParams(**kw)
    n = 20000
    tokens, logprobs = sample(row.expand(n, vocab).clone(), _seqs(n, params), frozenset())
    temp = params.temperature
    expected = _top_k_top_p((row / temp)[None], torch.tensor([params.vocab_top_k or vocab]),
                            torch.tensor([params.top_p]))[0].softmax(-1)
    counts = torch.bincount(torch.tensor(tokens), minlength=vocab).double() / n
    assert bool((counts[expected == 0] == 0).all()), "a filtered token was drawn"
    assert 0.5 * (counts - expected.double()).abs().sum() < 0.04  # total variation (expected ~0.02)
    ref = torch.log_softmax(row / temp, -1)[torch.tensor(tokens)]
    assert (torch.tensor(logprobs) - ref).abs().max() < 1e-6


def test_greedy_and_sampled_rows_mix_and_draws_do_not_depend_on_the_batch():
    torch.manual_seed(1)
    logits = torch.randn(6, 100)
    sampled = SamplingParams(temperature=1.0)
    greedy = SamplingParams(temperature=0.0)
    mixed = [Sequence("a", [1], sampled, torch.Generator().manual_seed(5)),
             Sequence("b", [1], greedy, torch.Generator().manual_seed(6)),
             Sequence("c", [1], sampled, torch.Generator().manual_seed(7))]
    tokens, logprobs = sample(logits[:3], mixed, frozenset())
    assert tokens[1] == int(logits[1].argmax())
    assert abs(logprobs[1] - float(torch.log_softmax(logits[1], -1).max())) < 1e-6
    alone, _ = sample(logits[2:3], [Sequence("c", [1], sampled, torch.Generator().manual_seed(7))], frozenset())
    assert alone[0] == tokens[2]


def test_top_k_beyond_the_vocabulary_keeps_every_token():
    logits = torch.randn(2, 100)
    params = SamplingParams(temperature=1.0, top_k=10**30, top_p=0.5)
    seqs = [Sequence(f"r{i}", [1], params, torch.Generator().manual_seed(i)) for i in range(2)]
    same = [Sequence(f"r{i}", [1], SamplingParams(temperature=1.0, top_p=0.5), torch.Generator().manual_seed(i))
            for i in range(2)]
    assert sample(logits, seqs, frozenset()) == sample(logits, same, frozenset())

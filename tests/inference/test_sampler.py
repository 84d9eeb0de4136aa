"""The batched sampler draws from the filtered distribution and returns the unfiltered logprob."""

from __future__ import annotations

import pytest
import torch

from tandem.inference import cpu_kernels, sampler
from tandem.inference.errors import RequestError
from tandem.inference.sampler import sample
from tandem.inference.sampling_params import SamplingParams
from tandem.inference.sequence import Sequence
from tests.inference.hf_sampling import hf_filtered_probs


def _seqs(n: int, params: SamplingParams) -> list[Sequence]:
    return [Sequence(f"r{i}", [1, 2, 3], params, torch.Generator().manual_seed(1000 + i)) for i in range(n)]


@pytest.fixture(params=["kernel", "pytorch"])
def draw_path(request, monkeypatch):
    """Each draw test runs through the C++ kernel (`csrc/sampler.cpp`) and through `_draw`."""
    if request.param == "kernel":
        assert cpu_kernels.sampler() is not None, "the sampler kernel did not build (see the logged warning)"
    else:
        monkeypatch.setattr(cpu_kernels, "sampler", lambda: None)
    return request.param


@pytest.mark.parametrize("vocab", [200, 64])  # 200: not a multiple of the 64-token blocks
@pytest.mark.parametrize("kw", [{}, {"temperature": 0.7, "top_k": 20}, {"temperature": 1.3, "top_p": 0.8},
                                {"temperature": 0.9, "top_p": 0.95, "min_p": 0.1}])
def test_draws_follow_the_filtered_distribution(vocab, kw, draw_path):
    """Catches draws that do not follow the filtered distribution transformers' warpers give (a wrong
    block or token picked by the two-level inverse CDF, a filtered token drawn) and a returned logprob
    that is not the unfiltered log_softmax(logits / T)."""
    torch.manual_seed(0)
    row = torch.randn(vocab) * 2
    params = SamplingParams(**kw)
    n = 20000
    tokens, logprobs = sample(row.expand(n, vocab).clone(), _seqs(n, params), frozenset())
    temp = params.temperature
    expected = hf_filtered_probs(row, params, [1, 2, 3]).float()  # transformers' warpers, not ours
    if params.min_p:  # independently of transformers: nothing below min_p times the top probability
        probs = (row / temp).softmax(-1)
        assert bool((expected[probs < params.min_p * probs.max()] == 0).all())
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


def test_repetition_penalty_is_sglangs_over_prompt_and_output_and_leaves_logprobs_alone():
    logits = torch.full((1, 16), -3.0)
    logits[0, 2], logits[0, 7], logits[0, 9] = 1.0, 0.8, -0.1  # 2 and 9 are in the prompt
    seq = Sequence("r", [2, 9, 4], SamplingParams(temperature=0.0, repetition_penalty=1.5), torch.Generator())
    tokens, logprobs = sample(logits.clone(), [seq], frozenset())
    assert tokens == [7]  # 1.0 / 1.5 < 0.8
    assert abs(logprobs[0] - float(torch.log_softmax(logits[0], -1)[7])) < 1e-6
    logits[0, 2], logits[0, 7] = -3.0, -0.12  # negative: 9 goes to -0.1 * 1.5 = -0.15, below 7
    tokens, _ = sample(logits.clone(), [seq], frozenset())
    assert tokens == [7] and int(logits[0].argmax()) == 9
    with pytest.raises(RequestError, match="repetition_penalty must be in"):
        SamplingParams(repetition_penalty=0.0)
    with pytest.raises(RequestError, match="min_p must be in"):
        SamplingParams(min_p=1.5)


@pytest.mark.parametrize("vocab", [16384, 200, 64, 17, 1])
def test_the_kernel_draws_what_the_pytorch_form_draws(vocab):
    """Catches the C++ draw searching differently from `_draw` (a block or token off by one, the
    last partial block or a vocabulary past a multiple of 16 mishandled, a wrong normaliser): the
    same tokens on random rows, filtered rows and uniforms at both ends of [0, 1)."""
    kernel = cpu_kernels.sampler()
    assert kernel is not None, "the sampler kernel did not build (see the logged warning)"
    gen = torch.Generator().manual_seed(vocab)
    rows = 96
    scaled = torch.randn(rows, vocab, generator=gen) * 4
    filtered = torch.rand(rows, vocab, generator=gen) < 0.7
    filtered[torch.arange(rows), scaled.argmax(-1)] = False  # filters always keep the most likely token
    scaled[rows // 2:] = scaled[rows // 2:].masked_fill(filtered[rows // 2:], float("-inf"))
    uniforms = torch.rand(rows, dtype=torch.float64, generator=gen)
    uniforms[:8] = 0.0
    uniforms[8:16] = 1.0 - 2.0 ** -53
    uniforms[rows // 2:rows // 2 + 8] = 0.0
    uniforms[rows // 2 + 8:rows // 2 + 16] = 1.0 - 2.0 ** -53
    want_tokens, want_norm = sampler._draw(scaled, uniforms)
    tokens, norm = kernel.draw(scaled, uniforms, sampler.DRAW_WIDTH)
    assert torch.equal(tokens, want_tokens)
    assert bool(scaled.gather(1, tokens[:, None]).isfinite().all()), "a filtered token was drawn"
    torch.testing.assert_close(norm, torch.logsumexp(scaled.double(), -1).float(), rtol=0, atol=2e-6)
    torch.testing.assert_close(norm, want_norm, rtol=0, atol=2e-6)
    kept = scaled > float("-inf")
    first_kept = kept.int().argmax(-1)
    last_kept = vocab - 1 - kept.flip(-1).int().argmax(-1)
    for start in (0, rows // 2):  # unfiltered rows, then filtered ones
        assert torch.equal(tokens[start:start + 8], first_kept[start:start + 8])  # u = 0: the first kept token
        assert torch.equal(tokens[start + 8:start + 16], last_kept[start + 8:start + 16])  # u -> 1: the last


def test_the_kernel_draw_of_a_row_does_not_depend_on_its_batch():
    """Catches rows of the C++ draw sharing work or state (`--batch-invariant` and seeded sampling
    rest on it): a row alone and inside a batch of 64 gives the same token and normaliser bits."""
    kernel = cpu_kernels.sampler()
    assert kernel is not None
    gen = torch.Generator().manual_seed(3)
    scaled = torch.randn(64, 1000, generator=gen) * 3
    uniforms = torch.rand(64, dtype=torch.float64, generator=gen)
    tokens, norm = kernel.draw(scaled, uniforms, sampler.DRAW_WIDTH)
    for row in (0, 17, 63):
        alone_tokens, alone_norm = kernel.draw(scaled[row:row + 1].clone(), uniforms[row:row + 1].clone(),
                                               sampler.DRAW_WIDTH)
        assert alone_tokens.item() == tokens[row].item()
        assert alone_norm.view(torch.int32).item() == norm[row].view(torch.int32).item()


def test_the_kernel_refuses_bad_input_naming_it():
    kernel = cpu_kernels.sampler()
    assert kernel is not None
    with pytest.raises(RuntimeError, match="float32"):
        kernel.draw(torch.zeros(2, 8, dtype=torch.float64), torch.zeros(2, dtype=torch.float64), 64)
    with pytest.raises(RuntimeError, match="one per row"):
        kernel.draw(torch.zeros(2, 8), torch.zeros(3, dtype=torch.float64), 64)
    with pytest.raises(RuntimeError, match="multiple of 16"):
        kernel.draw(torch.zeros(2, 8), torch.zeros(2, dtype=torch.float64), 40)

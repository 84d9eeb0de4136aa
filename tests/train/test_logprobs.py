"""`forward_logprobs` against a log-softmax over `transformers` logits, and chunking invariance."""

from __future__ import annotations

import pytest
import torch

from tandem.models import load_model
from tandem.train import SequenceBatch, TrainEngine
from tandem.train.logprobs import LogprobModel
from tests.models.hf_oracle import CASES, make_hf_model, random_sequences
from tests.train.helpers import engine_config

TOL = 1e-5
LENGTHS = [7, 13, 1, 10, 25]
PARITY_CASES = [c for c in CASES if c.id in ("qwen3-bias-mha-3layers", "qwen2-tied-gqa-hd12")]


@pytest.fixture(scope="module", params=PARITY_CASES, ids=[c.id for c in PARITY_CASES])
def hf_case(request, tmp_path_factory):
    case = request.param
    model = make_hf_model(case)
    path = tmp_path_factory.mktemp(case.id)
    model.save_pretrained(path)
    return case, model, path


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_forward_logprobs_match_transformers(hf_case, temperature):
    case, hf_model, path = hf_case
    seqs = random_sequences(case.vocab_size, LENGTHS)
    batch = SequenceBatch([{"input_ids": s} for s in seqs])
    # A small chunk size so that the output head really runs in several chunks.
    engine = TrainEngine(engine_config(str(path), logprob_chunk_size=8))
    out = engine.forward_logprobs(batch, temperature=temperature)
    engine.close()
    lp_diff = ent_diff = 0.0
    with torch.no_grad():
        for s, logprobs, entropy in zip(seqs, out.logprobs, out.entropy, strict=True):
            logits = hf_model(s[None]).logits[0].float() / temperature
            ref_all = torch.log_softmax(logits, -1)
            ref_lp = ref_all[:-1].gather(-1, s[1:, None])[:, 0]
            ref_ent = -(ref_all.exp() * ref_all).sum(-1)[:-1]
            assert logprobs.shape == s.shape and logprobs[-1] == 0 and entropy[-1] == 0
            lp_diff = max(lp_diff, (logprobs[:-1] - ref_lp).abs().max().item() if len(s) > 1 else 0.0)
            ent_diff = max(ent_diff, (entropy[:-1] - ref_ent).abs().max().item() if len(s) > 1 else 0.0)
    print(f"\n[logprobs] {case.id} T={temperature}: max |logprob diff| {lp_diff:.2e}, max |entropy diff| {ent_diff:.2e}")
    assert lp_diff <= TOL and ent_diff <= TOL


def test_chunked_head_gives_the_same_values_and_grads(hf_case):
    _, _, path = hf_case
    model = load_model(path)
    ids = torch.cat(random_sequences(model.args.vocab_size, LENGTHS, seed=2))
    cu = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], dtype=torch.int32)
    results = []
    for chunk in (5, 10_000):  # several recomputed chunks vs one plain pass
        model.zero_grad()
        lp, ent = LogprobModel(model, chunk_size=chunk)(ids, cu, temperature=0.9)
        (lp.sum() + 0.1 * ent.sum()).backward()
        results.append((lp.detach(), ent.detach(), [p.grad.clone() for p in model.parameters()]))
    (lp_a, ent_a, g_a), (lp_b, ent_b, g_b) = results
    assert torch.allclose(lp_a, lp_b, atol=1e-6) and torch.allclose(ent_a, ent_b, atol=1e-6)
    assert max((a - b).abs().max().item() for a, b in zip(g_a, g_b, strict=True)) <= 1e-5


@pytest.mark.parametrize("share", [0.3, 0.0])
def test_head_on_wanted_positions_only_gives_their_values_and_the_same_grads(hf_case, share):
    """`wanted` (the loss tokens) skips the output head elsewhere: same values there, 0 elsewhere,
    and the gradient of any loss over the wanted positions is unchanged (also when none is wanted)."""
    _, _, path = hf_case
    model = load_model(path)
    ids = torch.cat(random_sequences(model.args.vocab_size, LENGTHS, seed=3))
    cu = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], dtype=torch.int32)
    wanted = torch.rand(ids.shape[0], generator=torch.Generator().manual_seed(0)) < share
    results = []
    for w in (None, wanted):
        model.zero_grad()
        lp, ent = LogprobModel(model, chunk_size=8)(ids, cu, temperature=0.8, wanted=w)
        if w is not None:
            assert (lp[~wanted] == 0).all() and (ent[~wanted] == 0).all()
        mask = wanted.float()
        ((lp * mask).sum() + 0.1 * (ent * mask).sum()).backward()
        grads = [torch.zeros_like(p) if p.grad is None else p.grad.clone() for p in model.parameters()]
        results.append((lp.detach() * mask, ent.detach() * mask, grads))
    (lp_a, ent_a, g_a), (lp_b, ent_b, g_b) = results
    torch.testing.assert_close(lp_a, lp_b, rtol=0, atol=1e-6)
    torch.testing.assert_close(ent_a, ent_b, rtol=0, atol=1e-6)
    assert max((a - b).abs().max().item() for a, b in zip(g_a, g_b, strict=True)) <= 1e-5
    assert all(p.grad is not None for p in model.parameters())  # every parameter stays in the graph

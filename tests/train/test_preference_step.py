"""Bradley-Terry reward-model steps (`tandem.train.preference_step`) against an independent oracle:
transformers' `AutoModelForTokenClassification` scoring each sequence alone at its last token, the
mean pair loss -log sigmoid(s_chosen - s_rejected) by autograd, `clip_grad_norm_` and
`torch.optim.AdamW`. The engine packs the pairs into micro-batches too small to hold a pair, so the
two-pass update (scores first, then the linear surrogate) must carry each pair across them."""

from __future__ import annotations

import pytest
import torch

from tandem.data.preferences import PreferencePair, preference_batch
from tandem.train import TrainEngine
from tandem.train.config import MicroBatchConfig, OptimizerConfig
from tandem.train.preference_step import bradley_terry_update, pair_scores
from tests.train.helpers import engine_config, full_params, max_param_diff

OPTIMIZER = OptimizerConfig(lr=1e-3, beta1=0.8, beta2=0.95, eps=1e-4, weight_decay=0.1, gradient_clipping=1.0)
PARAM_TOL = 1e-6
SCORE_TOKEN = 0


@pytest.fixture(scope="module")
def reward_dir(tiny_dir, tmp_path_factory):
    """The tiny model as a one-label token classifier with a visible random head (a zero head would
    leave the decoder without gradient in the first step)."""
    import transformers

    torch.manual_seed(3)
    model = transformers.AutoModelForTokenClassification.from_pretrained(tiny_dir, num_labels=1, dtype=torch.float32)
    with torch.no_grad():
        model.score.weight.normal_(0.0, 0.5)
    out = tmp_path_factory.mktemp("rm") / "rm"
    model.save_pretrained(out, safe_serialization=True)
    return out


def _pairs(vocab: int, n: int = 6, seed: int = 0) -> list[PreferencePair]:
    gen = torch.Generator().manual_seed(seed)

    def seq() -> list[int]:
        return torch.randint(1, vocab, (int(torch.randint(12, 40, (), generator=gen)),), generator=gen).tolist()
    return [PreferencePair(seq(), seq()) for _ in range(n)]


def _oracle(path, pairs: list[PreferencePair], steps: int) -> tuple[list[dict[str, float]], dict[str, torch.Tensor]]:
    import transformers

    # eval(): HF's token classifier drops out its head's input in train mode (classifier_dropout);
    # the engine's value model has no dropout. Gradients flow the same.
    model = transformers.AutoModelForTokenClassification.from_pretrained(path, dtype=torch.float32).eval()
    c = OPTIMIZER
    opt = torch.optim.AdamW(model.parameters(), lr=c.lr, betas=(c.beta1, c.beta2), eps=c.eps,
                            weight_decay=c.weight_decay, foreach=False)
    stats = []
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        margins = torch.stack([model(torch.tensor([p.chosen])).logits[0, -1, 0]
                               - model(torch.tensor([p.rejected])).logits[0, -1, 0] for p in pairs])
        loss = torch.nn.functional.softplus(-margins).mean()
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), c.gradient_clipping)
        opt.step()
        stats.append({"loss": float(loss.detach()), "accuracy": float((margins > 0).float().mean()), "grad_norm": float(norm)})
    return stats, {n: t.detach().clone() for n, t in model.state_dict().items()}


def test_bradley_terry_steps_equal_autograd_through_transformers(reward_dir):
    """Catches: a score read at the wrong position (the score token's own, or the one before the
    last real token), a pair split across micro-batches losing its partner's score, a gradient sign
    or scale error (the surrogate's dL/ds, the mean over pairs), stats of the wrong pairs."""
    engine = TrainEngine(engine_config(str(reward_dir), optimizer=OPTIMIZER, total_train_steps=2,
                                       mb=MicroBatchConfig(max_tokens_per_mb=48)), head="value")
    pairs = _pairs(engine.model.args.vocab_size)
    batch = preference_batch(pairs, SCORE_TOKEN)
    assert len(engine._micro_batches(batch)) >= 6  # pairs (24-80 tokens) cannot fit one micro-batch
    stats = [bradley_terry_update(engine, batch) for _ in range(2)]
    params = full_params(engine)
    engine.close()
    ref_stats, ref_params = _oracle(reward_dir, pairs, 2)
    diff = max_param_diff(params, {n: ref_params[n] for n in params})
    for s, ref in zip(stats, ref_stats, strict=True):
        print(f"\n[bradley-terry] loss {s['reward/loss']:.8f} vs {ref['loss']:.8f}, grad norm "
              f"{s['reward/grad_norm']:.7f} vs {ref['grad_norm']:.7f}")
        assert s["reward/loss"] == pytest.approx(ref["loss"], rel=1e-6)
        assert s["reward/accuracy"] == pytest.approx(ref["accuracy"])
        assert s["reward/grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-5)
        assert s["reward/pairs"] == len(pairs)
    print(f"max |param diff| after 2 steps {diff:.2e}")
    assert ref_stats[0]["grad_norm"] > OPTIMIZER.gradient_clipping  # clipping really scales the step
    assert diff < PARAM_TOL


def test_scores_are_the_served_last_token_scores(reward_dir):
    """Catches: `pair_scores` reading a position other than the one transformers (and
    `tandem serve --is-embedding`) scores: the last token of the sequence without the score token."""
    import transformers

    engine = TrainEngine(engine_config(str(reward_dir)), head="value")
    pairs = _pairs(engine.model.args.vocab_size, n=3, seed=1)
    scores = pair_scores(engine, preference_batch(pairs, SCORE_TOKEN))
    engine.close()
    hf = transformers.AutoModelForTokenClassification.from_pretrained(reward_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = torch.tensor([[hf(torch.tensor([s])).logits[0, -1, 0] for s in (p.chosen, p.rejected)] for p in pairs])
    assert torch.allclose(scores, ref, atol=1e-5), (scores, ref)


def test_a_shard_that_is_not_whole_pairs_is_refused(reward_dir):
    engine = TrainEngine(engine_config(str(reward_dir)), head="value")
    batch = preference_batch(_pairs(engine.model.args.vocab_size, n=2), SCORE_TOKEN)
    with pytest.raises(ValueError, match="holds pairs"):
        pair_scores(engine, batch.select(range(3)))
    engine.close()

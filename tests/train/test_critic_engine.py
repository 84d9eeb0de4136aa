"""The training engine holding a value model (PPO's critic): built from a causal LM with a zero
head, trained with the clipped value loss, saved as an HF token classifier that transformers
loads and evaluates to the same values (an oracle independent of our model code)."""

from __future__ import annotations

import json

import pytest
import torch

from tandem.algo.config import PPOConfig
from tandem.algo.losses import ValueLoss, policy_loss_weight
from tandem.errors import ModelConfigError
from tandem.train import TrainEngine
from tests.train.helpers import engine_config, make_batch

TOL = 1e-5


def _value_batch(seed: int = 0):
    """The helpers' batch with old values and returns the critic regresses to."""
    batch = make_batch(512, seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    for seq in batch.seqs:
        n = seq["input_ids"].numel()
        seq["values"] = torch.zeros(n)
        seq["returns"] = torch.rand(n, generator=gen) * seq["loss_mask"]
    return batch


def test_a_critic_from_a_causal_lm_starts_at_zero_and_learns_the_returns(tiny_dir):
    """Catches: a head that is not zero-initialised (random first values), a head that no gradient
    reaches, or a loss that does not pull values towards the returns."""
    engine = TrainEngine(engine_config(str(tiny_dir)), head="value")
    batch = _value_batch()
    assert all(torch.equal(v, torch.zeros_like(v)) for v in engine.forward_values(batch))
    loss = ValueLoss(PPOConfig(value_eps_clip=10.0))  # no clipping: plain regression
    losses = [engine.train_batch(batch, loss, policy_loss_weight)["loss"] for _ in range(8)]
    values = engine.forward_values(batch, loss_tokens_only=True)
    engine.close()
    print(f"\n[critic] value loss {losses[0]:.4f} -> {losses[-1]:.4f}")
    assert losses[-1] < 0.5 * losses[0]
    # Values sit where the loss mask is (prediction alignment: the state each loss token comes from).
    for seq, v in zip(batch.seqs, values, strict=True):
        where = torch.roll(seq["loss_mask"], -1).bool()
        where[-1] = False
        assert torch.all(v[~where] == 0) and torch.any(v[where] != 0)


def test_a_saved_critic_is_an_hf_token_classifier_with_the_same_values(tiny_dir, tmp_path):
    """Oracle: transformers' own `AutoModelForTokenClassification` on the saved directory gives the
    engine's values; a second engine started from that directory gives them too (the value head is
    read back, not re-initialised)."""
    import transformers

    engine = TrainEngine(engine_config(str(tiny_dir)), head="value")
    batch = _value_batch()
    for _ in range(2):
        engine.train_batch(batch, ValueLoss(PPOConfig()), policy_loss_weight)
    ours = engine.forward_values(batch)
    out = engine.save_hf(tmp_path / "critic", tokenizer_dir=tiny_dir)
    engine.close()
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["Qwen3ForTokenClassification"] and len(config["id2label"]) == 1
    hf = transformers.AutoModelForTokenClassification.from_pretrained(out, dtype=torch.float32).eval()
    diff = 0.0
    with torch.no_grad():
        for seq, values in zip(batch.seqs, ours, strict=True):
            ref = hf(seq["input_ids"][None]).logits[0, :, 0]
            diff = max(diff, (values[:-1] - ref[:-1]).abs().max().item())
    print(f"\n[critic] max |value diff| vs transformers: {diff:.2e}")
    assert diff <= TOL
    again = TrainEngine(engine_config(str(out)), head="value")
    reread = again.forward_values(batch)
    again.close()
    assert all(torch.equal(a, b) for a, b in zip(ours, reread, strict=True))


def test_an_actor_refuses_a_value_model_checkpoint(tiny_dir, tmp_path):
    engine = TrainEngine(engine_config(str(tiny_dir)), head="value")
    out = engine.save_hf(tmp_path / "critic")
    engine.close()
    with pytest.raises(ModelConfigError, match=r"is a value model .*ForCausalLM"):
        TrainEngine(engine_config(str(out)))


def test_an_actor_refuses_a_reward_model_checkpoint(tiny_dir, tmp_path):
    """A transformers sequence classifier (a reward model) is not trained as a causal LM: its score
    head would be taken for the vocabulary's logits."""
    import json
    import shutil

    rm = tmp_path / "rm"
    shutil.copytree(tiny_dir, rm)
    cfg = json.loads((rm / "config.json").read_text())
    cfg.update(architectures=["Qwen3ForSequenceClassification"], num_labels=1)
    (rm / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelConfigError, match=r"is a sequence classifier \(a reward model\) .*ForCausalLM"):
        TrainEngine(engine_config(str(rm)))


def test_forward_of_the_wrong_kind_is_refused(tiny_dir):
    engine = TrainEngine(engine_config(str(tiny_dir)), head="value")
    with pytest.raises(TypeError, match="forward_values"):
        engine.forward_logprobs(make_batch(512))
    engine.close()

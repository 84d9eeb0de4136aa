"""Building, initialising, training-step and saving native models without an HF source."""

from __future__ import annotations

import json

import pytest
import torch
import transformers

from tandem.errors import CheckpointError
from tandem.models import build_model, load_model, save_model
from tests.models.hf_oracle import pack, random_sequences

CONFIG = {
    "model_type": "qwen3",
    "vocab_size": 96,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "tie_word_embeddings": True,
    "attention_bias": True,
    "eos_token_id": 3,
    "bos_token_id": 2,
}


def test_meta_build_allocates_nothing():
    model = build_model(CONFIG, device="meta")
    assert all(p.is_meta for p in model.parameters())
    assert model.model_type == "qwen3" and model.spec.name == "qwen"


def test_init_weights_is_deterministic_and_keeps_ties():
    a, b = build_model(CONFIG, seed=7), build_model(CONFIG, seed=7)
    c = build_model(CONFIG, seed=8)
    for (name, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters(), strict=True):
        assert torch.equal(pa, pb), name
        if name.endswith("norm.weight"):
            assert torch.equal(pa, torch.ones_like(pa)), name
        elif name.endswith("bias"):
            assert not pa.any(), name
        else:
            assert not torch.equal(pa, pc), name
    assert a.output.weight is a.tok_embeddings.weight
    assert abs(a.tok_embeddings.weight.std().item() - 0.02) < 0.005


def test_bf16_build_and_backward_reach_every_parameter():
    model = build_model(CONFIG, dtype=torch.bfloat16, seed=0)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    model = build_model(CONFIG, seed=0)
    input_ids, cu_seqlens = pack(random_sequences(96, [4, 6]))
    model(input_ids, cu_seqlens).float().logsumexp(-1).sum().backward()
    for name, param in model.named_parameters():
        assert param.grad is not None and param.grad.abs().sum() > 0, name


@torch.no_grad()
def test_explicit_positions():
    model = build_model(CONFIG, seed=0)
    input_ids, cu_seqlens = pack(random_sequences(96, [4, 6]))
    default = model(input_ids, cu_seqlens)
    explicit = torch.tensor([0, 1, 2, 3, 0, 1, 2, 3, 4, 5])
    assert torch.equal(model(input_ids, cu_seqlens, explicit), default)
    assert not torch.allclose(model(input_ids, cu_seqlens, explicit + 5), default)


def test_save_built_model_loads_in_transformers(tmp_path):
    model = build_model(CONFIG, seed=0)
    tokenizer_dir = tmp_path / "tok"
    tokenizer_dir.mkdir()
    (tokenizer_dir / "tokenizer_config.json").write_text("{}")
    (tokenizer_dir / "chat_template.jinja").write_text("{{ messages }}")
    out = save_model(model, tmp_path / "out", tokenizer_dir=tokenizer_dir)
    assert sorted(p.name for p in out.iterdir()) == [
        "chat_template.jinja",
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer_config.json",
    ]
    assert json.loads((out / "generation_config.json").read_text()) == {"bos_token_id": 2, "eos_token_id": 3}
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temp dirs left

    hf = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    seq = random_sequences(96, [9])[0]
    with torch.no_grad():
        torch.testing.assert_close(hf(seq[None]).logits[0], model(*pack([seq])), rtol=0, atol=1e-5)
    again = load_model(out)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), again.parameters(), strict=True))


def test_save_refuses_non_empty_directory_unless_overwrite(tmp_path):
    model = build_model(CONFIG, seed=0)
    out = tmp_path / "out"
    out.mkdir()
    (out / "stale.txt").write_text("old")
    with pytest.raises(CheckpointError, match="not empty"):
        save_model(model, out)
    save_model(model, out, overwrite=True)
    assert not (out / "stale.txt").exists() and (out / "model.safetensors").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    with pytest.raises(CheckpointError, match="tokenizer directory"):
        save_model(model, tmp_path / "other", tokenizer_dir=tmp_path / "missing")
    assert not (tmp_path / "other").exists() and sorted(p.name for p in tmp_path.iterdir()) == ["out"]

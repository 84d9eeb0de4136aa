"""`tandem init-model`: locally made models that transformers and Tandem load identically."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tandem.cli import main
from tandem.models import build_model, load_model
from tandem.models.tiny import PRESETS, hf_config_for, init_model

TANDEM = str(Path(sys.executable).with_name("tandem"))


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny")
    dirs = {}
    for arch in ("qwen3", "qwen2"):
        out = root / arch
        proc = subprocess.run(
            [TANDEM, "init-model", str(out), "--arch", arch, "--preset", "tiny", "--seed", "3"],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr
        assert f"wrote {arch} preset 'tiny' (seed 3)" in proc.stdout
        dirs[arch] = out
    return dirs


@pytest.mark.parametrize("arch", ["qwen3", "qwen2"])
def test_transformers_loads_model_and_tokenizer(tiny_dirs, arch, monkeypatch):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    path = tiny_dirs[arch]
    tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    hf = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=torch.float32).eval()
    ours = load_model(path)
    assert len(tok) == ours.args.vocab_size == PRESETS["tiny"].vocab_size
    assert tok.eos_token_id == hf.config.eos_token_id

    messages = [{"role": "user", "content": "What is 37 + 58?"}]
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    ids = torch.tensor(ids)
    with torch.no_grad():
        hf_logits = hf(ids[None]).logits[0]
        our_logits = ours(ids, torch.tensor([0, len(ids)], dtype=torch.int32))
    assert (hf_logits - our_logits).abs().max().item() <= 1e-5

    # transformers can generate with it (greedy) and our model agrees on every generated token.
    with torch.no_grad():
        out = hf.generate(ids[None], max_new_tokens=8, do_sample=False, pad_token_id=tok.pad_token_id)[0]
        logits = ours(out, torch.tensor([0, len(out)], dtype=torch.int32))
    generated = out[len(ids):]
    assert torch.equal(logits[len(ids) - 1 : len(out) - 1].argmax(-1)[: len(generated)], generated)


def test_same_seed_same_weights_other_seed_differs(tiny_dirs, tmp_path):
    init_model(tmp_path / "again", arch="qwen3", preset="tiny", seed=3)
    init_model(tmp_path / "other", arch="qwen3", preset="tiny", seed=4)
    first = load_file(tiny_dirs["qwen3"] / "model.safetensors")
    again = load_file(tmp_path / "again" / "model.safetensors")
    other = load_file(tmp_path / "other" / "model.safetensors")
    assert first.keys() == again.keys() == other.keys()
    assert all(torch.equal(first[k], again[k]) for k in first)
    assert not torch.equal(first["model.embed_tokens.weight"], other["model.embed_tokens.weight"])
    assert (tiny_dirs["qwen3"] / "tokenizer.json").read_bytes() == (tmp_path / "again" / "tokenizer.json").read_bytes()


@pytest.mark.parametrize(
    ("preset", "low", "high"), [("tiny", 80_000, 130_000), ("small", 2_000_000, 3_000_000), ("medium", 20_000_000, 30_000_000),
                                 ("base", 90_000_000, 110_000_000)]
)
@pytest.mark.parametrize("arch", ["qwen3", "qwen2"])
def test_preset_sizes(arch, preset, low, high):
    model = build_model(hf_config_for(arch, preset, {"eos_token_id": 2, "pad_token_id": 0}), device="meta")
    assert low <= sum(p.numel() for p in model.parameters()) <= high


def test_refuses_to_overwrite_unless_asked(tiny_dirs, capsys):
    assert main(["init-model", str(tiny_dirs["qwen2"]), "--preset", "tiny"]) == 2
    assert "is not empty; pass overwrite=True" in capsys.readouterr().err


def test_overwrite_replaces(tmp_path):
    init_model(tmp_path / "m", preset="tiny", seed=1)
    assert main(["init-model", str(tmp_path / "m"), "--preset", "tiny", "--seed", "2", "--overwrite"]) == 0
    assert [p.name for p in tmp_path.iterdir()] == ["m"]  # no temporary or old directories left behind

"""Broken or inconsistent HF directories fail with a CheckpointError that names the culprit."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tandem.errors import CheckpointError, ModelConfigError
from tandem.models import build_model, load_model, read_hf_config
from tandem.train.sharded_load import load_hf_weights_sharded
from tests.models.hf_oracle import Case, make_hf_model

CASE = Case("qwen3-tied", "qwen3", 64, 32, 2, 4, 2, tie=True)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("ckpt") / "hf"
    make_hf_model(CASE).save_pretrained(path)
    return path


@pytest.fixture
def copy(hf_dir, tmp_path) -> Path:
    return Path(shutil.copytree(hf_dir, tmp_path / "model"))


def _rewrite(path: Path, edit) -> None:
    file = path / "model.safetensors"
    tensors = load_file(file)
    edit(tensors)
    save_file(tensors, file, metadata={"format": "pt"})


def test_missing_path(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        load_model(tmp_path / "nope")


def test_path_is_a_file(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(CheckpointError, match="not a directory"):
        load_model(tmp_path / "f")


def test_no_config_json(copy):
    (copy / "config.json").unlink()
    with pytest.raises(CheckpointError, match=r"no config\.json"):
        read_hf_config(copy)


def test_no_safetensors(copy):
    (copy / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no safetensors weights"):
        load_model(copy)


@pytest.mark.parametrize("damage", ["truncate", "garbage"])
def test_corrupt_safetensors_names_the_file(copy, damage):
    file = copy / "model.safetensors"
    data = file.read_bytes()
    file.write_bytes(data[: len(data) // 2] if damage == "truncate" else b"\x00not safetensors" * 64)
    with pytest.raises(CheckpointError, match=r"corrupt or truncated .*model\.safetensors"):
        load_model(copy)


def test_index_naming_a_missing_shard(copy):
    (copy / "model.safetensors").rename(copy / "model-00001-of-00002.safetensors")
    weight_map = {
        "model.embed_tokens.weight": "model-00001-of-00002.safetensors",
        "model.norm.weight": "model-00002-of-00002.safetensors",
    }
    (copy / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(CheckpointError, match=r"model-00002-of-00002\.safetensors.*missing"):
        load_model(copy)


def test_missing_tensor_is_named(copy):
    _rewrite(copy, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(CheckpointError, match=r"missing tensors: model\.layers\.1\.mlp\.up_proj\.weight"):
        load_model(copy)


@pytest.mark.parametrize("name", ["model.layers.0.mlp.extra.weight", "model.layers.7.mlp.up_proj.weight"])
def test_unexpected_tensor_is_named(copy, name):
    _rewrite(copy, lambda t: t.update({name: torch.zeros(2)}))
    with pytest.raises(CheckpointError, match=f"unexpected tensors: {name}"):
        load_model(copy)


def test_wrong_shape_is_named(copy):
    _rewrite(copy, lambda t: t.update({"model.norm.weight": torch.ones(31)}))
    with pytest.raises(CheckpointError, match=r"model\.norm\.weight \(expected \(32,\), got \(31,\)"):
        load_model(copy)


@pytest.mark.parametrize("value, what", [(float("nan"), "NaN"), (float("-inf"), "inf"), (float("inf"), "inf")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_non_finite_weights_are_refused_naming_tensor_and_file(copy, value, what, dtype):
    name = "model.layers.1.mlp.up_proj.weight"

    def poison(t):
        t[name] = t[name].to(dtype)
        t[name].view(-1)[7] = value

    _rewrite(copy, poison)
    needle = re.escape(f"tensor '{name}' in '{copy / 'model.safetensors'}' holds {what} values")
    with pytest.raises(CheckpointError, match=needle):
        load_model(copy)  # what `tandem serve` and `tandem model-info` load with
    model = build_model(read_hf_config(copy), device="meta").to_empty(device="cpu")
    model.tie_weights()
    with pytest.raises(CheckpointError, match=needle):
        load_hf_weights_sharded(model, copy)  # what the trainer loads with


def test_harmless_extras_are_accepted(copy, hf_dir):
    # Old checkpoints carry RoPE buffers; some tied checkpoints still store lm_head.
    def add(t):
        t["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(4)
        t["lm_head.weight"] = t["model.embed_tokens.weight"].clone()

    _rewrite(copy, add)
    model = load_model(copy)
    assert torch.equal(model.tok_embeddings.weight, load_model(hf_dir).tok_embeddings.weight)
    assert model.output.weight is model.tok_embeddings.weight


def test_unsupported_model_type_lists_supported(copy):
    config = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps({**config, "model_type": "llama"}))
    with pytest.raises(ModelConfigError, match=r"unsupported model_type 'llama'; supported: .*qwen2, qwen3"):
        load_model(copy)

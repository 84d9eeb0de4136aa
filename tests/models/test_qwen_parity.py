"""Parity of the native Qwen2/Qwen3 models with transformers, and HF checkpoint round trips."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from safetensors import safe_open

from tandem.models import load_model, save_model
from tandem.models.common import Routing
from tandem.models.hf_checkpoint import INDEX_NAME, SINGLE_FILE_NAME, iter_hf_tensors
from tests.models.hf_oracle import CASES, Case, hf_padded_logits, make_hf_model, pack, random_sequences

LENGTHS = [7, 13, 1, 10]
TOL = 1e-5


@pytest.fixture(scope="module", params=CASES, ids=[c.id for c in CASES])
def case(request, tmp_path_factory):
    """(case, HF model, directory the HF model was saved to)."""
    torch.set_num_threads(2)
    spec: Case = request.param
    hf_model = make_hf_model(spec)
    path = tmp_path_factory.mktemp(spec.id) / "hf"
    hf_model.save_pretrained(path)
    return spec, hf_model, path


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    return dict(iter_hf_tensors(path))


@torch.no_grad()
def test_packed_forward_matches_hf_padded_batch(case):
    spec, hf_model, path = case
    model = load_model(path)
    seqs = random_sequences(spec.vocab_size, LENGTHS)
    input_ids, cu_seqlens = pack(seqs)
    ours = model(input_ids, cu_seqlens)
    ref = torch.cat(hf_padded_logits(hf_model, seqs))
    diff = (ours - ref).abs().max().item()
    print(f"\n[parity] {spec.id}: max |logit diff| vs HF = {diff:.3e} (max |logit| {ref.abs().max():.2f})")
    assert ours.shape == (sum(LENGTHS), spec.vocab_size)
    assert diff <= TOL


@torch.no_grad()
def test_packed_equals_each_sequence_alone(case):
    spec, _, path = case
    model = load_model(path)
    seqs = random_sequences(spec.vocab_size, LENGTHS, seed=1)
    packed = model(*pack(seqs))
    alone = torch.cat([model(*pack([s])) for s in seqs])
    diff = (packed - alone).abs().max().item()
    print(f"\n[packing] {spec.id}: max |packed - alone| = {diff:.3e}")
    assert diff <= TOL
    # hidden_states + logits_from_hidden in token chunks is the forward computation (up to GEMM
    # blocking, which may change the last bits).
    h = model.hidden_states(*pack(seqs))
    chunked = torch.cat([model.logits_from_hidden(c) for c in h.split(5)])
    torch.testing.assert_close(chunked, packed, rtol=0, atol=TOL)


def test_hf_round_trip_is_bit_exact_and_loads_in_transformers(case, tmp_path):
    spec, hf_model, path = case
    model = load_model(path)
    out = save_model(model, tmp_path / "out")
    original, saved = _tensors(path), _tensors(out)
    assert saved.keys() == original.keys()
    for name, tensor in original.items():
        assert saved[name].dtype == tensor.dtype and saved[name].shape == tensor.shape, name
        assert torch.equal(saved[name], tensor), name
    assert ("lm_head.weight" in saved) == (not spec.tie)
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == [type(hf_model).__name__]
    assert config["model_type"] == spec.model_type and config["dtype"] == "float32"

    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    seqs = random_sequences(spec.vocab_size, LENGTHS, seed=2)
    for got, want in zip(hf_padded_logits(reloaded, seqs), hf_padded_logits(hf_model, seqs), strict=True):
        assert torch.equal(got, want)


def test_sharded_save_loads_back_identically(case, tmp_path):
    spec, hf_model, path = case
    model = load_model(path)
    out = save_model(model, tmp_path / "sharded", max_shard_bytes=16 * 1024)
    shards = sorted(out.glob("model-*-of-*.safetensors"))
    assert len(shards) >= 2 and (out / INDEX_NAME).is_file() and not (out / SINGLE_FILE_NAME).exists()
    index = json.loads((out / INDEX_NAME).read_text())
    for name, file in index["weight_map"].items():
        with safe_open(out / file, "pt") as f:
            assert name in f.keys()  # noqa: SIM118
    again = load_model(out)
    for (name, a), (_, b) in zip(model.state_dict().items(), again.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    if spec.tie:
        assert again.output.weight is again.tok_embeddings.weight
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    seqs = random_sequences(spec.vocab_size, LENGTHS, seed=3)
    for got, want in zip(hf_padded_logits(reloaded, seqs), hf_padded_logits(hf_model, seqs), strict=True):
        assert torch.equal(got, want)


@torch.no_grad()
def test_bf16_load_is_close_to_fp32_and_to_hf_bf16(case):
    spec, _, path = case
    fp32 = load_model(path)
    bf16 = load_model(path, dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in bf16.parameters())
    assert load_model(path, dtype=None).tok_embeddings.weight.dtype == torch.float32  # config dtype
    seqs = random_sequences(spec.vocab_size, LENGTHS, seed=4)
    # MoE: bf16 round-off flips some top-k choices, and a flipped expert moves a logit by far more
    # than round-off; the bf16 forward replays fp32's routes so that only precision is compared.
    routes = Routing(record=True)
    want = fp32(*pack(seqs), routing=routes)
    got = bf16(*pack(seqs), routing=Routing(replay=routes.recorded))
    assert got.dtype == torch.bfloat16
    diff = (got.float() - want).abs().max().item()
    scale = want.abs().max().item()
    print(f"\n[bf16] {spec.id}: max |bf16 - fp32| = {diff:.3e} (max |logit| {scale:.2f})")
    assert diff <= 0.05 * scale + 0.05

    # Same ops in the same order as HF, so one unpadded sequence agrees to within a bf16 ulp or two
    # (bit-exact on the machines we measured).
    hf_bf16 = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    seq = seqs[1]
    hf_diff = (bf16(*pack([seq])).float() - hf_bf16(seq[None]).logits[0].float()).abs().max().item()
    print(f"[bf16] {spec.id}: max |ours - HF| (bf16, one sequence) = {hf_diff:.3e}")
    assert hf_diff <= 0.0625

"""Shared fixtures: tiny local models whose weights are scaled up so outputs are varied, and one
that overflows on one input token.

`init_model`'s 0.02 init gives near-uniform logits and a model that repeats its last token; weights
of unit-ish scale (as in tests/models/hf_oracle.py) make greedy paths, EOS and stop strings matter.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tandem.models import load_model, save_model
from tandem.models.tiny import init_model


@torch.no_grad()
def make_model_dir(root: Path, arch: str = "qwen3", seed: int = 0, overrides: dict | None = None) -> Path:
    base = init_model(root / f"{arch}-base", arch=arch, preset="tiny", seed=seed, overrides=overrides)
    model = load_model(base)
    gen = torch.Generator().manual_seed(seed)
    for name, param in model.named_parameters():
        noise = torch.randn(param.shape, generator=gen)
        if "norm" in name:
            param.copy_(1.0 + 0.2 * noise)
        elif name.endswith("bias"):
            param.copy_(0.5 * noise)
        else:
            param.copy_(noise / param.shape[-1] ** 0.5)
    return save_model(model, root / arch, tokenizer_dir=base)


OVERFLOW_TOKEN = 5  # in the overflow model, any prompt holding this token gets NaN logits


@torch.no_grad()
def make_overflow_model_dir(root: Path, seed: int = 0) -> Path:
    """A model whose weights are all finite but overflow float32 activations for one input token:
    only `OVERFLOW_TOKEN`'s embedding has a component along hidden dim 0, and layer 0's v_proj
    maps that dim to values near float32's largest (3e38), so the value vector of that token
    overflows to inf and every later position's logits become NaN. Other prompts never touch
    dim 0 in layer 0 and stay finite."""
    base = make_model_dir(root / "overflow-base", "qwen3", seed=seed)
    model = load_model(base)
    emb = model.tok_embeddings.weight
    emb[:, 0] = 0.0
    emb[OVERFLOW_TOKEN] = 0.0
    emb[OVERFLOW_TOKEN, 0] = 1.0
    model.layers["0"].attention.wv.weight[:, 0] = 3e38
    return save_model(model, root / "overflow", tokenizer_dir=base)


@pytest.fixture(scope="session", autouse=True)
def _threads():
    torch.set_num_threads(2)


@pytest.fixture(scope="session")
def qwen3_dir(tmp_path_factory) -> Path:
    return make_model_dir(tmp_path_factory.mktemp("models"), "qwen3")


@pytest.fixture(scope="session")
def qwen2_dir(tmp_path_factory) -> Path:
    return make_model_dir(tmp_path_factory.mktemp("models"), "qwen2")


# Three layers, the middle one dense: routes come back on the whole layer axis with -1 there.
MOE_OVERRIDES = {"num_hidden_layers": 3, "mlp_only_layers": [1]}


@pytest.fixture(scope="session")
def moe_dir(tmp_path_factory) -> Path:
    return make_model_dir(tmp_path_factory.mktemp("models"), "qwen3_moe", overrides=MOE_OVERRIDES)


def prompts(lengths: list[int], vocab: int = 512, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    # Skip the low ids: the tiny tokenizer's special tokens (pad 0, eos 2, ...) live there.
    return [torch.randint(10, vocab, (n,), generator=gen).tolist() for n in lengths]


@pytest.fixture(scope="session")
def overflow_dir(tmp_path_factory) -> Path:
    return make_overflow_model_dir(tmp_path_factory.mktemp("models"))

"""Sizes of the locally made models, and `init_model`, which writes one as an HF directory.

No model hub is reachable here, so development, tests and the demo use small Qwen-shaped models
made from these presets with a tokenizer trained on the built-in tasks' text. They go through the
same `config.json` + safetensors path as real checkpoints, so nothing downstream special-cases them.
"""

from __future__ import annotations

import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from tandem.errors import ModelConfigError


@dataclass(frozen=True)
class Preset:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int


# Parameter counts (tied embeddings, qwen3): tiny ~107k, small ~2.9M, medium ~23M, base ~101M
# (base: head_dim 64 and 3 query heads per KV head, the shape of a real small model's decode).
PRESETS: dict[str, Preset] = {
    "tiny": Preset(512, 64, 2, 4, 2, 16, 128),
    "small": Preset(2048, 256, 4, 4, 2, 64, 512),
    "medium": Preset(8192, 512, 6, 8, 4, 64, 1536),
    "base": Preset(16384, 768, 14, 12, 4, 64, 2048),
}
ARCHES = ("qwen3", "qwen2", "qwen3_moe")
# What a qwen3_moe model of a preset adds: 8 experts, 2 per token, each a quarter of the dense
# feed-forward's width (Qwen3-30B-A3B's proportions are 128 experts, 8 per token, 768 of 6144).
MOE_PRESET = {"num_experts": 8, "num_experts_per_tok": 2, "norm_topk_prob": True}


def get_preset(name: str) -> Preset:
    if name not in PRESETS:
        raise ModelConfigError(f"preset {name!r} is unknown; choose one of {', '.join(PRESETS)}")
    return PRESETS[name]


def hf_config_for(arch: str, preset: str, special_ids: dict[str, int], overrides: dict | None = None) -> dict:
    """A complete `config.json` dict, written by transformers' own config class for `arch`;
    `overrides` replaces preset values or defaults (e.g. `{"num_hidden_layers": 4,
    "tie_word_embeddings": False}`)."""
    from transformers import Qwen2Config, Qwen3Config, Qwen3MoeConfig

    if arch not in ARCHES:
        raise ModelConfigError(f"arch {arch!r} is not supported; choose one of {', '.join(ARCHES)}")
    values = {
        **asdict(get_preset(preset)),
        "max_position_embeddings": 4096,
        "rope_theta": 10000.0,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": True,
        "initializer_range": 0.02,
        # Qwen convention: no BOS is prepended; bos_token_id names the end-of-turn token.
        "bos_token_id": special_ids["eos_token_id"],
        "eos_token_id": special_ids["eos_token_id"],
        "pad_token_id": special_ids["pad_token_id"],
    }
    if arch == "qwen3_moe":
        values.update(MOE_PRESET, moe_intermediate_size=values["intermediate_size"] // 4)
    values.update(overrides or {})
    config_cls = {"qwen3": Qwen3Config, "qwen2": Qwen2Config, "qwen3_moe": Qwen3MoeConfig}[arch]
    config = config_cls(**values)
    # The diff against the class defaults, as `save_pretrained` writes it: real checkpoints look so.
    return config.to_diff_dict()


def init_model(
    out_dir: str | Path, arch: str = "qwen3", preset: str = "tiny", seed: int = 0, overwrite: bool = False,
    overrides: dict | None = None,
) -> Path:
    """Write a randomly initialised `arch` model of size `preset` with its tokenizer to `out_dir`;
    `overrides`: config values to change (see `hf_config_for`)."""
    # torch and the tokenizer trainer: reading the presets (`tandem show-config`) needs neither.
    from tandem.models import build_model, save_model
    from tandem.models.tiny.tokenizer import build_tokenizer, save_tokenizer, special_token_ids

    tokenizer = build_tokenizer(vocab_size=get_preset(preset).vocab_size)
    hf_config = hf_config_for(arch, preset, special_token_ids(tokenizer), overrides)
    model = build_model(hf_config, dtype=torch.float32, device="cpu")
    model.init_weights(seed)
    with tempfile.TemporaryDirectory() as tok_dir:
        save_tokenizer(tokenizer, tok_dir)
        save_model(model, out_dir, tokenizer_dir=tok_dir, overwrite=overwrite)
    return Path(out_dir)

"""`QwenArgs`: the hyper-parameters of a Qwen2 / Qwen3 dense model, read from an HF `config.json`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tandem.errors import ModelConfigError
from tandem.models.value_head import classifier_labels, is_value_config

MODEL_TYPES = ("qwen2", "qwen3")
_REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
# transformers' Qwen3Config defaults head_dim to 128 (not hidden/heads); Qwen2Config has no such field.
_QWEN3_DEFAULT_HEAD_DIM = 128


@dataclass
class QwenArgs:
    model_type: str
    vocab_size: int
    dim: int
    intermediate_size: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False
    max_seq_len: int = 32768
    initializer_range: float = 0.02
    # A value model (`tandem.models.value_head`): the output head is `[dim] -> 1` (with a bias)
    # instead of the vocabulary logits, and it is never tied to the embedding.
    value_head: bool = False
    # A sequence classifier (a reward model, `classifier_labels`): the output head is `[dim] ->
    # num_labels` without a bias, read at each sequence's last token; 0: not one.
    num_labels: int = 0

    def __post_init__(self) -> None:
        if self.n_heads % self.n_kv_heads:
            raise ModelConfigError(
                f"num_attention_heads ({self.n_heads}) must be a multiple of num_key_value_heads "
                f"({self.n_kv_heads})"
            )

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> QwenArgs:
        model_type = cfg.get("model_type")
        if model_type not in MODEL_TYPES:
            raise ModelConfigError(f"model_type {model_type!r} is not a Qwen dense type {MODEL_TYPES}")
        return cls(**qwen_fields(cfg, default_head_dim=_QWEN3_DEFAULT_HEAD_DIM if model_type == "qwen3" else None))

    def is_moe_layer(self, layer: int) -> bool:
        """Whether block `layer` has a mixture of experts instead of a dense feed-forward."""
        return False

    def to_hf_config(self) -> dict[str, Any]:
        """A minimal HF config for a model built from args alone (no source config.json)."""
        cfg: dict[str, Any] = {
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.dim,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.n_layers,
            "num_attention_heads": self.n_heads,
            "num_key_value_heads": self.n_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.norm_eps,
            "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta},
            "tie_word_embeddings": self.tie_word_embeddings,
            "max_position_embeddings": self.max_seq_len,
            "initializer_range": self.initializer_range,
            "use_sliding_window": False,
        }
        if self.model_type != "qwen2":
            cfg["attention_bias"] = self.qkv_bias
        return cfg


def qwen_fields(cfg: dict[str, Any], default_head_dim: int | None = None) -> dict[str, Any]:
    """The `QwenArgs` fields of an HF config of any Qwen decoder (dense or MoE); `default_head_dim`
    when the config has no `head_dim` (None: hidden_size / num_attention_heads)."""
    model_type = cfg["model_type"]
    for key in _REQUIRED:
        if cfg.get(key) is None:
            raise ModelConfigError(f"config.json for {model_type} lacks required key {key!r}")
    _check_supported(cfg)
    n_heads = int(cfg["num_attention_heads"])
    is_qwen2 = model_type == "qwen2"
    attention_bias = bool(cfg.get("attention_bias", False))
    return dict(
        model_type=model_type,
        vocab_size=int(cfg["vocab_size"]),
        dim=int(cfg["hidden_size"]),
        intermediate_size=int(cfg["intermediate_size"]),
        n_layers=int(cfg["num_hidden_layers"]),
        n_heads=n_heads,
        n_kv_heads=int(cfg.get("num_key_value_heads") or n_heads),
        head_dim=int(cfg.get("head_dim") or default_head_dim or cfg["hidden_size"] // n_heads),
        norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=_rope_theta(cfg),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        # Qwen2 always has q/k/v biases and none on o; Qwen3's `attention_bias` covers q/k/v/o.
        qkv_bias=True if is_qwen2 else attention_bias,
        o_bias=False if is_qwen2 else attention_bias,
        qk_norm=not is_qwen2,
        max_seq_len=int(cfg.get("max_position_embeddings", 32768)),
        initializer_range=float(cfg.get("initializer_range", 0.02)),
        value_head=is_value_config(cfg),
        num_labels=classifier_labels(cfg),
    )


def _check_supported(cfg: dict[str, Any]) -> None:
    """Reject features this implementation would silently get wrong."""
    if cfg.get("use_sliding_window"):
        raise ModelConfigError(
            "use_sliding_window=true is not supported (full attention only); set it to false"
        )
    layer_types = cfg.get("layer_types") or []
    if any(t != "full_attention" for t in layer_types):
        raise ModelConfigError(
            f"layer_types {sorted(set(layer_types))} is not supported: only 'full_attention'"
        )
    if cfg.get("hidden_act", "silu") != "silu":
        raise ModelConfigError(f"hidden_act {cfg['hidden_act']!r} is not supported: only 'silu'")
    if cfg.get("attention_dropout", 0.0):
        raise ModelConfigError(
            f"attention_dropout={cfg['attention_dropout']} is not supported: set it to 0.0"
        )


def _rope_theta(cfg: dict[str, Any]) -> float:
    """transformers >= 5 nests RoPE under `rope_parameters`; older configs use top-level keys."""
    for field in ("rope_parameters", "rope_scaling"):
        params = cfg.get(field) or {}
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type != "default":
            raise ModelConfigError(
                f"{field} with rope_type {rope_type!r} is not supported: only default RoPE "
                f"(rope_type 'default', no rope scaling)"
            )
    params = cfg.get("rope_parameters") or {}
    return float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))

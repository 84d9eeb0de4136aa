"""Name mapping between native Qwen parameters and HF checkpoint tensors.

Mapping is per name so checkpoints can be streamed one tensor at a time; the tensors themselves
are never transformed (the layouts are identical), which keeps HF -> native -> HF bit-exact.
"""

from __future__ import annotations

import re

import torch

from tandem.errors import CheckpointError
from tandem.models.qwen.args import QwenArgs
from tandem.models.state_dict_adapter import StateDictAdapter
from tandem.models.value_head import SCORE_BIAS, SCORE_WEIGHT

# HF suffix inside `model.layers.{i}.` -> native suffix inside `layers.{i}.`
_LAYER_NAMES = {
    "self_attn.q_proj.weight": "attention.wq.weight",
    "self_attn.k_proj.weight": "attention.wk.weight",
    "self_attn.v_proj.weight": "attention.wv.weight",
    "self_attn.o_proj.weight": "attention.wo.weight",
    "self_attn.q_proj.bias": "attention.wq.bias",
    "self_attn.k_proj.bias": "attention.wk.bias",
    "self_attn.v_proj.bias": "attention.wv.bias",
    "self_attn.o_proj.bias": "attention.wo.bias",
    "self_attn.q_norm.weight": "attention.q_norm.weight",
    "self_attn.k_norm.weight": "attention.k_norm.weight",
    "input_layernorm.weight": "attention_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "feed_forward.w1.weight",
    "mlp.down_proj.weight": "feed_forward.w2.weight",
    "mlp.up_proj.weight": "feed_forward.w3.weight",
}
_NATIVE_LAYER_NAMES = {v: k for k, v in _LAYER_NAMES.items()}
_TOP_NAMES = {"model.embed_tokens.weight": "tok_embeddings.weight", "model.norm.weight": "norm.weight"}
_NATIVE_TOP_NAMES = {v: k for k, v in _TOP_NAMES.items()}
_VALUE_HEAD = {SCORE_WEIGHT: "output.weight", SCORE_BIAS: "output.bias"}
_NATIVE_VALUE_HEAD = {v: k for k, v in _VALUE_HEAD.items()}
_HF_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
_NATIVE_LAYER = re.compile(r"layers\.(\d+)\.(.+)")
# Tensors older checkpoints carry that hold nothing a model needs (recomputed RoPE frequencies).
_HARMLESS = re.compile(r"(model\.)?(layers\.\d+\.self_attn\.)?rotary_emb\.inv_freq")


class QwenStateDictAdapter(StateDictAdapter):
    def __init__(self, args: QwenArgs):
        self.args = args

    def hf_to_native(self, name: str) -> str | None:
        """Native name for an HF tensor; None for tensors to skip (tied `lm_head`, stale RoPE buffers).

        Raises CheckpointError for a name this family does not know.
        """
        if name in _TOP_NAMES:
            return _TOP_NAMES[name]
        if self.args.num_labels and name == SCORE_WEIGHT:  # a sequence classifier's head
            return "output.weight"
        if self.args.value_head:  # `score.*` is the head; an LM head (a critic made from an LM) is not used
            if name in _VALUE_HEAD:
                return _VALUE_HEAD[name]
            if name == "lm_head.weight":
                return None
        if name == "lm_head.weight":
            # Tied checkpoints usually omit it; when present it duplicates the embedding.
            return None if self.args.tie_word_embeddings else "output.weight"
        if match := _HF_LAYER.fullmatch(name):
            layer, suffix = match.groups()
            if suffix in _LAYER_NAMES:
                return f"layers.{layer}.{_LAYER_NAMES[suffix]}"
        if _HARMLESS.fullmatch(name):
            return None
        raise CheckpointError(f"unexpected tensor {name!r}: not part of a {self.args.model_type} checkpoint")

    def native_to_hf(self, name: str) -> str:
        if name in _NATIVE_TOP_NAMES:
            return _NATIVE_TOP_NAMES[name]
        if self.args.num_labels and name == "output.weight":
            return SCORE_WEIGHT
        if self.args.value_head and name in _NATIVE_VALUE_HEAD:
            return _NATIVE_VALUE_HEAD[name]
        if name == "output.weight":
            return "lm_head.weight"
        if (match := _NATIVE_LAYER.fullmatch(name)) and match.group(2) in _NATIVE_LAYER_NAMES:
            return f"model.layers.{match.group(1)}.{_NATIVE_LAYER_NAMES[match.group(2)]}"
        raise KeyError(f"no HF name for native parameter {name!r}")

    def pieces(self, native_name: str, shape: torch.Size | tuple[int, ...]) -> list[tuple[str, int | None]]:
        """Tied models have no `lm_head.weight` piece: HF files store the shared tensor once."""
        if (native_name == "output.weight" and self.args.tie_word_embeddings and not self.args.value_head
                and not self.args.num_labels):
            return []
        return super().pieces(native_name, shape)

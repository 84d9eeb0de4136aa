"""Model-agnostic building blocks shared by the model families."""

from tandem.models.common.attention import (
    packed_causal_attention,
    packed_document_mask,
    padded_causal_attention,
)
from tandem.models.common.mlp import SwiGLU
from tandem.models.common.moe import GroupedExperts, MoE, Routing, grouped_swiglu, load_balancing_loss
from tandem.models.common.norm import RMSNorm
from tandem.models.common.packing import positions_from_cu_seqlens, sequence_ids
from tandem.models.common.rope import RotaryEmbedding, apply_rotary_emb

__all__ = [
    "GroupedExperts",
    "MoE",
    "RMSNorm",
    "RotaryEmbedding",
    "Routing",
    "SwiGLU",
    "apply_rotary_emb",
    "grouped_swiglu",
    "load_balancing_loss",
    "packed_causal_attention",
    "packed_document_mask",
    "padded_causal_attention",
    "positions_from_cu_seqlens",
    "sequence_ids",
]

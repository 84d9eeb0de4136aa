"""Causal attention over packed variable-length sequences.

Sequences are concatenated along the token dimension and delimited by `cu_seqlens` (cumulative
lengths, `[B+1]`, starting at 0). A token attends to earlier tokens of its own sequence only.

This implementation builds a dense `[T, T]` boolean block-diagonal causal mask and calls SDPA: it
runs forward and backward on CPU (flex_attention backward does not) and is exact. It costs O(T^2)
memory, so on CUDA a varlen kernel should replace this one function.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tandem.models.common.packing import sequence_ids


def packed_document_mask(cu_seqlens: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """`[T, T]` bool mask, True where query i may attend to key j (same sequence, j <= i)."""
    ids = sequence_ids(cu_seqlens, num_tokens)
    idx = torch.arange(num_tokens, device=cu_seqlens.device)
    return (ids[:, None] == ids[None, :]) & (idx[:, None] >= idx[None, :])


def packed_causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    scale: float | None = None,
) -> torch.Tensor:
    """q `[T, H, D]`, k/v `[T, H_kv, D]` (H a multiple of H_kv) -> `[T, H, D]`."""
    num_tokens, num_heads = q.shape[0], q.shape[1]
    if num_heads % k.shape[1]:
        raise ValueError(f"query heads ({num_heads}) must be a multiple of key/value heads ({k.shape[1]})")
    mask = packed_document_mask(cu_seqlens, num_tokens)
    # SDPA wants [batch, heads, tokens, dim]; the packed batch is one "batch" row.
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None],
        k.transpose(0, 1)[None],
        v.transpose(0, 1)[None],
        attn_mask=mask,
        scale=scale,
        enable_gqa=num_heads != k.shape[1],
    )
    return out[0].transpose(0, 1)

"""Attention over a paged KV cache, pure PyTorch (any device).

The KV cache of one layer is `[num_blocks, block_size, n_kv_heads, head_dim]` for k and for v. A
step's tokens are packed like the training path (`cu_seqlens_q`); each sequence's keys are the
ones already cached plus its new ones, found through its block table. `paged_attention` is the one
function a CUDA kernel (flash-attn / flashinfer with a block table) replaces.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tandem.models.common import packed_causal_attention


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] flat cache slot (block * block_size + offset) of each new token
    cu_seqlens_q: torch.Tensor  # [B+1] new tokens per sequence, cumulative
    context_lens: torch.Tensor  # [B] keys per sequence: cached + new
    block_tables: torch.Tensor  # [B, max_blocks], padded with 0 (masked out)
    max_query_len: int
    max_context_len: int
    no_cached_prefix: bool  # every sequence attends only to its new tokens (plain prefill)


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slot_mapping, v)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """q `[T, H, D]` -> `[T, H, D]`: each query attends causally to its sequence's cached keys.

    Sequences are padded to the longest query and context and run as one masked SDPA batch; the
    query at index t of a sequence with c keys and l new tokens sits at position c - l + t and may
    see keys 0..c - l + t. Padded query rows are computed and dropped.
    """
    num_seqs = meta.context_lens.shape[0]
    device = q.device
    keys = k_cache[meta.block_tables].flatten(1, 2)[:, : meta.max_context_len]  # [B, K, H_kv, D]
    values = v_cache[meta.block_tables].flatten(1, 2)[:, : meta.max_context_len]
    q_lens = meta.cu_seqlens_q[1:] - meta.cu_seqlens_q[:-1]
    t = torch.arange(meta.max_query_len, device=device)
    q_index = (meta.cu_seqlens_q[:-1, None] + t[None, :]).clamp(max=q.shape[0] - 1)  # [B, Q]
    q_valid = t[None, :] < q_lens[:, None]
    q_pos = (meta.context_lens - q_lens)[:, None] + t[None, :]
    k_pos = torch.arange(meta.max_context_len, device=device)
    mask = k_pos[None, None, :] <= q_pos[:, :, None]  # [B, Q, K]
    out = F.scaled_dot_product_attention(
        q[q_index].transpose(1, 2),  # [B, H, Q, D]
        keys.transpose(1, 2),
        values.transpose(1, 2),
        attn_mask=mask[:, None],
        scale=scale,
        enable_gqa=q.shape[1] != k_cache.shape[2],
    )
    assert out.shape[0] == num_seqs
    return out.transpose(1, 2)[q_valid]


class PagedAttentionBackend:
    """The model's attention hook for one step: store the new k/v, then attend through the cache."""

    def __init__(self, k_caches: list[torch.Tensor], v_caches: list[torch.Tensor], scale: float):
        self.k_caches, self.v_caches, self.scale = k_caches, v_caches, scale
        self.meta: AttentionMetadata | None = None

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        meta = self.meta
        assert meta is not None, "set the step's AttentionMetadata first"
        k_cache, v_cache = self.k_caches[layer], self.v_caches[layer]
        write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        if meta.no_cached_prefix and meta.context_lens.shape[0] == 1:
            # One sequence, nothing cached: the packed training path is exact and cheapest. With
            # several, its dense [T, T] mask is O(T^2): padding per sequence (below) is O(B * L^2).
            return packed_causal_attention(q, k, v, meta.cu_seqlens_q, scale=self.scale)
        return paged_attention(q, k_cache, v_cache, meta, self.scale)

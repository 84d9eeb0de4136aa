"""Causal attention over packed variable-length sequences: `packed_causal_attention(q, k, v, cu_seqlens)`.

Sequences are concatenated along the token dimension and delimited by `cu_seqlens` (`[B+1]`, from
0); a token attends to earlier tokens of its own sequence only. Exact, forward and backward on CPU
(flex_attention's backward is not), in the cheaper of two forms: padded `[B, L_max]` or a dense
`[T, T]` block-diagonal mask (docs/training.md, "Batches"). On CUDA a varlen kernel should replace
this one function."""

from __future__ import annotations

import itertools

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
    if not torch.compiler.is_compiling():
        bounds = cu_seqlens.tolist()
        if bounds[-1] < num_tokens:  # trailing padding tokens attend among themselves, as in the mask
            bounds.append(num_tokens)
        lengths = [b - a for a, b in itertools.pairwise(bounds)]
        longest = max(lengths, default=0)
        if len(lengths) * longest * longest <= num_tokens * num_tokens:
            return padded_causal_attention(q, k, v, lengths, scale)
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


def padded_causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: list[int], scale: float | None
) -> torch.Tensor:
    """One batched causal SDPA over a `[B, L_max]` layout, no mask: a real query never sees the
    padding after its sequence, and padded queries are dropped (a sequence's result does not
    depend on the others' values, NaN included). O(B L^2); `lengths` sum to T."""
    device = q.device
    longest = max(lengths)
    lens = torch.tensor(lengths, device=device)
    seq = torch.repeat_interleave(torch.arange(len(lengths), device=device), lens)
    starts = torch.cumsum(lens, 0) - lens
    pos = torch.arange(q.shape[0], device=device) - starts[seq]

    def pad(x: torch.Tensor) -> torch.Tensor:  # [T, h, D] -> [B, h, L, D]; differentiable in x
        out = x.new_zeros(len(lengths), longest, *x.shape[1:]).index_put((seq, pos), x)
        return out.transpose(1, 2)

    out = F.scaled_dot_product_attention(
        pad(q), pad(k), pad(v), is_causal=True, scale=scale, enable_gqa=q.shape[1] != k.shape[1]
    )
    return out.transpose(1, 2)[seq, pos]

"""Packed variable-length attention against per-sequence causal SDPA, forward and backward."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tandem.models.common import packed_causal_attention, packed_document_mask, positions_from_cu_seqlens

LENGTHS = [5, 1, 9, 3]  # B * L^2 <= T^2: the padded implementation
SKEWED = [30, 1, 1, 2]  # one long sequence: B * L^2 > T^2, the dense-mask implementation


def _reference(q, k, v, lengths):
    """Each sequence alone through SDPA with is_causal=True (kv heads repeated for GQA)."""
    rep = q.shape[1] // k.shape[1]
    outs = []
    for qs, ks, vs in zip(q.split(lengths), k.split(lengths), v.split(lengths), strict=True):
        ks, vs = ks.repeat_interleave(rep, dim=1), vs.repeat_interleave(rep, dim=1)
        out = F.scaled_dot_product_attention(
            qs.transpose(0, 1)[None], ks.transpose(0, 1)[None], vs.transpose(0, 1)[None], is_causal=True
        )
        outs.append(out[0].transpose(0, 1))
    return torch.cat(outs)


@pytest.mark.parametrize("lengths", [LENGTHS, SKEWED, [7]], ids=["padded", "dense", "one"])
@pytest.mark.parametrize("kv_heads", [4, 2, 1])
def test_packed_attention_matches_per_sequence_causal_sdpa_with_grads(kv_heads, lengths):
    gen = torch.Generator().manual_seed(kv_heads)
    total, heads, dim = sum(lengths), 4, 8
    q = torch.randn(total, heads, dim, generator=gen, requires_grad=True)
    k = torch.randn(total, kv_heads, dim, generator=gen, requires_grad=True)
    v = torch.randn(total, kv_heads, dim, generator=gen, requires_grad=True)
    cu_seqlens = torch.tensor([0, *lengths]).cumsum(0).to(torch.int32)

    out = packed_causal_attention(q, k, v, cu_seqlens)
    ref = _reference(q, k, v, lengths)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-6)

    grad_out = torch.randn(out.shape, generator=gen)
    grads = torch.autograd.grad(out, (q, k, v), grad_out)
    ref_grads = torch.autograd.grad(ref, (q, k, v), grad_out)
    for got, want in zip(grads, ref_grads, strict=True):
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def test_trailing_padding_tokens_attend_among_themselves_in_both_implementations():
    """Tokens past cu_seqlens[-1] (micro-batch padding) form one more causal segment, whichever
    implementation runs (the dense mask gives them sequence id B)."""
    gen = torch.Generator().manual_seed(0)
    for lengths, pad in (([4, 3], 2), ([12, 1], 3)):  # padded / dense choice
        total = sum(lengths) + pad
        q, k, v = (torch.randn(total, 2, 8, generator=gen) for _ in range(3))
        cu_seqlens = torch.tensor([0, *lengths]).cumsum(0).to(torch.int32)
        out = packed_causal_attention(q, k, v, cu_seqlens)
        torch.testing.assert_close(out, _reference(q, k, v, [*lengths, pad]), rtol=0, atol=1e-6)


def test_document_mask_is_block_diagonal_causal():
    cu_seqlens = torch.tensor([0, 2, 5], dtype=torch.int32)
    mask = packed_document_mask(cu_seqlens, 5).int()
    expected = torch.tensor(
        [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [0, 0, 1, 0, 0], [0, 0, 1, 1, 0], [0, 0, 1, 1, 1]]
    )
    assert torch.equal(mask, expected)


def test_positions_restart_per_sequence():
    cu_seqlens = torch.tensor([0, 3, 4, 8], dtype=torch.int32)
    assert positions_from_cu_seqlens(cu_seqlens, 8).tolist() == [0, 1, 2, 0, 0, 1, 2, 3]

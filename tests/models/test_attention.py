"""Packed variable-length attention against per-sequence causal SDPA, forward and backward."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tandem.models.common import packed_causal_attention, packed_document_mask, positions_from_cu_seqlens
from tandem.models.common.attention import PackedAttention, choose_kernel, sdpa_causal_attention
from tests.varlen_reference import reference_varlen

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


# ------------------------------------------------------------------ the CUDA kernels' paths on CPU
# Lengths past FlexAttention's 128-token blocks (so the block mask skips and masks whole blocks),
# a sequence of one token, and trailing padding (T > cu_seqlens[-1]).
FLEX_LENGTHS, FLEX_PAD = [150, 3, 90, 1], 6


def _stream(kv_heads: int, lengths: list[int], pad: int, dtype=torch.float32, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    total = sum(lengths) + pad
    q, k, v = (torch.randn(total, h, 16, generator=gen, dtype=dtype) for h in (4, kv_heads, kv_heads))
    return q, k, v, torch.tensor([0, *lengths]).cumsum(0).to(torch.int32)


def _dense(q, k, v, cu_seqlens):
    return sdpa_causal_attention(q, k, v, cu_seqlens, None, 0.3)  # None: the dense-mask form


@pytest.mark.parametrize("kv_heads", [4, 2])
def test_flex_path_equals_the_dense_mask_path_forward(kv_heads):
    """FlexAttention with the plan's document block mask (torch's CPU kernel, forward only)."""
    q, k, v, cu = _stream(kv_heads, FLEX_LENGTHS, FLEX_PAD)
    plan = PackedAttention.plan(cu, q.shape[0], "flex")
    assert plan.lengths == (*FLEX_LENGTHS, FLEX_PAD) and plan.max_len == 150
    torch.testing.assert_close(plan(q, k, v, 0.3), _dense(q, k, v, cu), rtol=0, atol=1e-5)


@pytest.mark.parametrize("kv_heads", [4, 2])
def test_flex_path_equals_the_dense_mask_path_backward(monkeypatch, kv_heads):
    """Forward and backward of the flex path against the dense mask. torch refuses FlexAttention's
    backward on CPU in its front end only (`_validate_device`); lifted here, the same higher-order
    op and block mask run torch's reference (unfused) backward, which CUDA replaces with its fused
    kernel (tests/gpu/test_cuda_paths.py compares that one)."""
    import torch.nn.attention.flex_attention as flex

    monkeypatch.setattr(flex, "_validate_device", lambda *tensors: None)
    q, k, v, cu = _stream(kv_heads, FLEX_LENGTHS, FLEX_PAD, dtype=torch.float64)
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    out = PackedAttention.plan(cu, q.shape[0], "flex")(q, k, v, 0.3)
    ref = _dense(q, k, v, cu)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-5)
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=out.dtype)
    for got, want in zip(torch.autograd.grad(out, (q, k, v), grad_out), torch.autograd.grad(ref, (q, k, v), grad_out),
                         strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


@pytest.mark.parametrize("takes_gqa", [True, False], ids=["torch>=2.12", "torch-2.11"])
def test_varlen_path_passes_the_kernel_the_trailing_segment_causal_window_and_kv_heads(monkeypatch, takes_gqa):
    """The flash kernel runs on CUDA only; here its contract (a per-sequence reference) stands in,
    to check what the plan hands it: int32 bounds with the padding as one more sequence, the
    longest length, the causal window, and GQA as each torch version takes it."""
    import tandem.models.common.attention as attention

    calls: list[dict] = []
    monkeypatch.setattr(attention, "VARLEN", (reference_varlen(calls, takes_gqa), takes_gqa))
    q, k, v, cu = _stream(2, FLEX_LENGTHS, FLEX_PAD)
    out = PackedAttention.plan(cu, q.shape[0], "varlen")(q, k, v, 0.3)
    torch.testing.assert_close(out, _dense(q, k, v, cu), rtol=0, atol=1e-5)
    assert calls == [dict(dtype=torch.int32, max_q=150, max_k=150, window=(-1, 0),
                          kv_heads=2 if takes_gqa else 4, gqa=takes_gqa, splits=None)]


def test_kernel_choice_by_device_and_dtype():
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert choose_kernel("auto", cpu, torch.bfloat16, 128) == "sdpa"
    assert choose_kernel("auto", cuda, torch.bfloat16, 128) == "varlen"
    assert choose_kernel("auto", cuda, torch.float16, 64) == "varlen"
    assert choose_kernel("auto", cuda, torch.float32, 128) == "flex"  # flash has no fp32
    assert choose_kernel("auto", cuda, torch.bfloat16, 12) == "flex"  # nor head sizes off multiples of 8
    assert choose_kernel("sdpa", cuda, torch.bfloat16, 128) == "sdpa"
    with pytest.raises(ValueError, match="attention kernel 'fast' is unknown; choose one of auto, sdpa"):
        choose_kernel("fast", cpu, torch.float32, 64)


def test_a_model_planned_with_flex_gives_the_sdpa_logits():
    """The model plans its attention once per forward and hands it to every layer."""
    from tandem.models.qwen.args import QwenArgs
    from tandem.models.qwen.model import QwenModel

    args = QwenArgs(model_type="qwen3", vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, intermediate_size=48, qk_norm=True)
    model = QwenModel(args)
    model.init_weights(seed=0)
    ids = torch.randint(0, 64, (sum(FLEX_LENGTHS),), generator=torch.Generator().manual_seed(0))
    cu = torch.tensor([0, *FLEX_LENGTHS]).cumsum(0).to(torch.int32)
    with torch.no_grad():
        want = model(ids, cu)
        model.attention_kernel = "flex"
        got = model(ids, cu)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)

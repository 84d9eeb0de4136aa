"""Item 1: the CUDA attention kernels against the dense-mask path, on the device.

- Training: `PackedAttention` with flash attention's varlen kernel (bfloat16) and with
  FlexAttention under a document mask (float32, compiled), forward and backward, against SDPA
  under the dense `[T, T]` document mask of the same inputs (the CPU's exact path), GQA included,
  sequences longer than Flex's 128-token blocks and trailing padding included.
- Serving: `varlen_paged_attention` (keys gathered from the paged cache, flash varlen) for decodes
  and for prefills after cached prefixes, against float64 attention over each sequence's keys.

On CPU (`TANDEM_TEST_DEVICE=cpu`) these skip: the kernels are CUDA's; what the code hands them is
checked on CPU in tests/models/test_attention.py and tests/inference/test_paged_attention.py."""

from __future__ import annotations

import pytest
import torch

from tandem.inference.paged_attention import AttentionMetadata, build_gathered_keys, varlen_paged_attention
from tandem.models.common.attention import (
    PackedAttention,
    choose_kernel,
    sdpa_causal_attention,
    varlen_available,
)

pytestmark = pytest.mark.timeout(300)

LENGTHS, PAD = [300, 1, 77, 129, 40], 11  # T = 558: several Flex blocks, a 1-token sequence, padding


@pytest.fixture(autouse=True)
def _cuda_only(device):
    if device.type != "cuda":
        pytest.skip("the varlen and flex kernels run on CUDA (their CPU contract: tests/models/test_attention.py)")
    if not varlen_available():
        pytest.fail(f"torch {torch.__version__} has no torch.nn.attention.varlen", pytrace=False)


def _inputs(device, dtype, kv_heads=2, seed=0):
    gen = torch.Generator(device=device).manual_seed(seed)
    total = sum(LENGTHS) + PAD
    q, k, v = (torch.randn(total, h, 64, generator=gen, device=device, dtype=dtype).requires_grad_()
               for h in (8, kv_heads, kv_heads))
    cu = torch.tensor([0, *LENGTHS], device=device).cumsum(0).to(torch.int32)
    return q, k, v, cu


def _fwd_bwd(fn, q, k, v, grad_out):
    out = fn(q, k, v)
    return (out, *torch.autograd.grad(out, (q, k, v), grad_out))


def _compare(kernel: str, dtype: torch.dtype, device, kv_heads: int) -> float:
    q, k, v, cu = _inputs(device, dtype, kv_heads)
    plan = PackedAttention.plan(cu, q.shape[0], kernel)
    grad_out = torch.randn(q.shape, device=device, dtype=dtype)
    got = _fwd_bwd(lambda *x: plan(*x, 0.125), q, k, v, grad_out)
    # The dense-mask path in float32 from the same (rounded) inputs: the truth both dtypes meet.
    ref_in = [x.detach().float().requires_grad_() for x in (q, k, v)]
    want = _fwd_bwd(lambda *x: sdpa_causal_attention(*x, cu, None, 0.125), *ref_in, grad_out.float())
    worst = max(float((a.float() - b).abs().max()) for a, b in zip(got, want, strict=True))
    print(f"\n[gpu] {kernel} {str(dtype)[6:]} kv_heads={kv_heads}: max |diff| vs dense mask (fwd, dq, dk, dv) "
          f"{worst:.2e}")
    return worst


@pytest.mark.parametrize("kv_heads", [8, 2])
def test_varlen_training_path_equals_the_dense_mask_bf16(device, kv_heads):
    assert choose_kernel("auto", device, torch.bfloat16, 64) == "varlen"
    assert _compare("varlen", torch.bfloat16, device, kv_heads) < 3e-2  # bf16 outputs and gradients


@pytest.mark.parametrize("kv_heads", [8, 2])
def test_flex_training_path_equals_the_dense_mask_fp32(device, kv_heads):
    assert choose_kernel("auto", device, torch.float32, 64) == "flex"
    assert _compare("flex", torch.float32, device, kv_heads) < 1e-4


def test_served_varlen_attention_equals_float64_attention_over_the_cache(device):
    torch.manual_seed(3)
    h, h_kv, bs, d, blocks = 8, 2, 16, 64, 300
    k_cache = torch.randn(h_kv, blocks, bs, d, device=device, dtype=torch.bfloat16)
    v_cache = torch.randn(h_kv, blocks, bs, d, device=device, dtype=torch.bfloat16)
    stored = k_cache.transpose(-1, -2).contiguous()  # the key cache's layout: transposed per block
    cached, new = [0, 5, 16, 200, 31, 700], [40, 17, 1, 1, 1, 3]  # prefills and decodes in one step
    lens = [c + n for c, n in zip(cached, new, strict=True)]
    free = torch.randperm(blocks - 1).add(1).tolist()
    tables = [[free.pop() for _ in range(-(-n // bs))] for n in lens]
    q = torch.randn(sum(new), h, d, device=device, dtype=torch.bfloat16)
    cu_q = torch.tensor([0, *new], device=device).cumsum(0).to(torch.int32)
    meta = AttentionMetadata(slot_mapping=torch.zeros(0, dtype=torch.long, device=device), cu_seqlens_q=cu_q,
                             context_lens=torch.tensor(lens, dtype=torch.int32, device=device), block_tables=None,
                             max_query_len=max(new), max_context_len=max(lens), no_cached_prefix=False,
                             gathered=build_gathered_keys(tables, lens, bs, device))
    out = varlen_paged_attention(q, stored, v_cache, meta, d**-0.5)
    worst, first = 0.0, 0
    for table, context, n in zip(tables, lens, new, strict=True):
        keys = k_cache[:, table].reshape(h_kv, -1, d)[:, :context].double()
        values = v_cache[:, table].reshape(h_kv, -1, d)[:, :context].double()
        for t in range(n):
            visible = context - n + t + 1
            qi = q[first + t].double().view(h_kv, h // h_kv, d)
            w = torch.softmax(qi @ keys[:, :visible].transpose(-1, -2) * d**-0.5, dim=-1)
            worst = max(worst, float((out[first + t].double() - (w @ values[:, :visible]).reshape(-1, d)).abs().max()))
        first += n
    print(f"\n[gpu] served varlen bf16: max |diff| vs float64 over the cache {worst:.2e}")
    assert worst < 2e-2  # the output rounded to bf16 once, plus bf16 probabilities in the kernel

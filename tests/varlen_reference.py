"""torch's flash `varlen_attn` contract on CPU, where the kernel does not run: what the CUDA
attention paths hand it is checked against per-sequence SDPA (tests/models/test_attention.py,
tests/inference/test_paged_attention.py); the kernel itself is compared on CUDA (tests/gpu)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def reference_varlen(calls: list[dict], takes_gqa: bool):
    """torch's `varlen_attn` contract on CPU, from per-sequence SDPA: sequence i's queries
    `cu_q[i]:cu_q[i+1]` against its keys `cu_k[i]:cu_k[i+1]`, causal aligned to the last key."""

    def varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=(-1, -1), enable_gqa=False,
                    num_splits=None):
        calls.append(dict(dtype=cu_q.dtype, max_q=max_q, max_k=max_k, window=window_size, kv_heads=k.shape[1],
                          gqa=enable_gqa, splits=num_splits))
        assert takes_gqa or (not enable_gqa and num_splits is None)  # torch 2.11 takes neither
        outs = []
        bq, bk = cu_q.tolist(), cu_k.tolist()
        for i in range(len(bq) - 1):
            qs, ks, vs = q[bq[i]:bq[i + 1]], k[bk[i]:bk[i + 1]], v[bk[i]:bk[i + 1]]
            assert qs.shape[0] <= max_q and ks.shape[0] <= max_k
            allowed = torch.ones(qs.shape[0], ks.shape[0], dtype=torch.bool).tril(ks.shape[0] - qs.shape[0])
            out = F.scaled_dot_product_attention(qs.transpose(0, 1), ks.transpose(0, 1), vs.transpose(0, 1),
                                                 attn_mask=allowed, scale=scale, enable_gqa=enable_gqa)
            outs.append(out.transpose(0, 1))
        return torch.cat(outs)

    return varlen_attn

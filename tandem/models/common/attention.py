"""Causal attention over packed variable-length sequences: `packed_causal_attention(q, k, v, cu_seqlens)`.

Sequences are concatenated along the token dimension and delimited by `cu_seqlens` (`[B+1]`, from
0); a token attends to earlier tokens of its own sequence only, and tokens past `cu_seqlens[-1]`
(micro-batch padding) form one more sequence. Three kernels, chosen by device and dtype
(`choose_kernel`; docs/training.md, "Batches"):

- `sdpa` (CPU): exact forward and backward, in the cheaper of two forms: padded `[B, L_max]` or a
  dense `[T, T]` block-diagonal mask;
- `varlen` (CUDA, fp16/bf16): torch's flash-attention varlen kernel (`torch.nn.attention.varlen`);
- `flex` (CUDA where varlen cannot serve, e.g. fp32): FlexAttention with a document mask.

`PackedAttention.plan` does the per-batch work once (lengths to the host, the block mask) outside
compiled blocks; the model passes the plan to every layer."""

from __future__ import annotations

import inspect
import itertools
from dataclasses import dataclass
from functools import cache
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

from tandem.models.common.packing import sequence_ids

KERNELS = ("auto", "sdpa", "varlen", "flex")
VARLEN_DTYPES = (torch.float16, torch.bfloat16)  # flash attention's


def _find_varlen() -> tuple[Any, bool] | None:
    """(torch's `varlen_attn`, whether it takes `enable_gqa` and `num_splits`: torch >= 2.12), or
    None where torch has none."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    params = inspect.signature(varlen_attn).parameters
    return varlen_attn, "enable_gqa" in params and "num_splits" in params


# torch's varlen module, looked up on first use (importing it costs ~1.3 s) and by every plan
# before the compiled blocks run: a signature read inside a compiled block would break its graph.
_UNSET: Any = object()
VARLEN: Any = _UNSET


def varlen() -> tuple[Any, bool] | None:
    global VARLEN
    if VARLEN is _UNSET:
        VARLEN = _find_varlen()
    return VARLEN


def varlen_available() -> bool:
    return varlen() is not None


def choose_kernel(setting: str, device: torch.device, dtype: torch.dtype, head_dim: int) -> str:
    """The kernel `setting` (one of `KERNELS`) means on `device` for `dtype`: `auto` is `sdpa`
    off CUDA, `varlen` on CUDA where the flash kernel serves the dtype and head size, else `flex`."""
    if setting not in KERNELS:
        raise ValueError(f"attention kernel {setting!r} is unknown; choose one of {', '.join(KERNELS)}")
    if setting != "auto":
        return setting
    if device.type != "cuda":
        return "sdpa"
    if varlen_available() and dtype in VARLEN_DTYPES and head_dim % 8 == 0 and head_dim <= 256:
        return "varlen"
    return "flex"


def packed_document_mask(cu_seqlens: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """`[T, T]` bool mask, True where query i may attend to key j (same sequence, j <= i)."""
    ids = sequence_ids(cu_seqlens, num_tokens)
    idx = torch.arange(num_tokens, device=cu_seqlens.device)
    return (ids[:, None] == ids[None, :]) & (idx[:, None] >= idx[None, :])


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor,
                     max_q: int, max_k: int, scale: float | None = None, batch_invariant: bool = False) -> torch.Tensor:
    """Causal flash attention over packed sequences: q `[T_q, H, D]`, k/v `[T_k, H_kv, D]`,
    sequence i's queries `cu_q[i]:cu_q[i+1]` against its keys `cu_k[i]:cu_k[i+1]` (int32). With
    more keys than queries the queries are the sequence's last ones (a query at position p sees
    keys 0..p): prefill over a cached prefix, and decode. CUDA, fp16/bf16. `batch_invariant`: no
    split over keys, whose choice follows the batch's longest sequence (torch >= 2.12 splits by
    default; 2.11's varlen forward never does)."""
    found = VARLEN if VARLEN is not _UNSET else varlen()
    if found is None:
        raise RuntimeError(f"torch {torch.__version__} has no torch.nn.attention.varlen: use attention kernel "
                           "flex or sdpa")
    varlen_attn, newer = found
    extra: dict[str, Any] = {"num_splits": 1} if batch_invariant and newer else {}
    if q.shape[1] != k.shape[1]:
        if newer:
            extra["enable_gqa"] = True
        else:  # torch < 2.12 documents equal head counts only: repeat the kv heads
            k, v = (x.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for x in (k, v))
    return varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, scale=scale, window_size=(-1, 0), **extra)


@dataclass(frozen=True, eq=False)
class PackedAttention:
    """Causal attention over one packed stream of `num_tokens` tokens, planned once per forward
    (`plan`): `cu_seqlens` (int32) with the trailing padding as one more sequence, the longest
    sequence, and for `flex` the block mask. Called as a layer's attention: `(q, k, v) -> out`."""

    kernel: str
    cu_seqlens: torch.Tensor
    num_tokens: int
    max_len: int
    lengths: tuple[int, ...]
    block_mask: Any = None  # torch.nn.attention.flex_attention.BlockMask, for flex

    @classmethod
    def plan(cls, cu_seqlens: torch.Tensor, num_tokens: int, kernel: str) -> PackedAttention:
        """One host sync (the lengths); `kernel` is a concrete one (`choose_kernel`)."""
        bounds = _bounds(cu_seqlens, num_tokens)
        lengths = tuple(b - a for a, b in itertools.pairwise(bounds))
        cu = torch.tensor(bounds, dtype=torch.int32, device=cu_seqlens.device)
        block_mask = _document_block_mask(cu, num_tokens) if kernel == "flex" else None
        if kernel == "varlen":
            varlen()  # resolved here, outside compiled blocks
        return cls(kernel, cu, num_tokens, max(lengths, default=0), lengths, block_mask)

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None) -> torch.Tensor:
        if q.shape[0] != self.num_tokens:
            raise ValueError(f"planned for {self.num_tokens} tokens, got {q.shape[0]}")
        if q.shape[1] % k.shape[1]:
            raise ValueError(f"query heads ({q.shape[1]}) must be a multiple of key/value heads ({k.shape[1]})")
        if self.kernel == "varlen":
            return varlen_attention(q, k, v, self.cu_seqlens, self.cu_seqlens, self.max_len, self.max_len, scale)
        if self.kernel == "flex":
            return flex_causal_attention(q, k, v, self.block_mask, scale)
        if self.kernel == "sdpa":
            return sdpa_causal_attention(q, k, v, self.cu_seqlens, list(self.lengths), scale)
        raise ValueError(f"attention kernel {self.kernel!r} is not a concrete one (see choose_kernel)")


def _document_block_mask(cu_seqlens: torch.Tensor, num_tokens: int) -> Any:
    ids = sequence_ids(cu_seqlens, num_tokens)

    def document_causal(b: Any, h: Any, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
        return (ids[q_idx] == ids[kv_idx]) & (q_idx >= kv_idx)

    return create_block_mask(document_causal, None, None, num_tokens, num_tokens, device=cu_seqlens.device)


@cache
def _compiled_flex() -> Any:
    return torch.compile(flex_attention, dynamic=True)


def flex_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_mask: Any,
                          scale: float | None = None) -> torch.Tensor:
    """FlexAttention over `block_mask` (a document mask, `PackedAttention.plan`). Compiled on CUDA
    (eager flex is torch's unfused reference); inside a compiled block it is part of that graph."""
    fn = flex_attention if q.device.type != "cuda" or torch.compiler.is_compiling() else _compiled_flex()
    out = fn(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], block_mask=block_mask,
             scale=scale, enable_gqa=q.shape[1] != k.shape[1])
    return out[0].transpose(0, 1)


def packed_causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    scale: float | None = None,
    kernel: str = "auto",
) -> torch.Tensor:
    """q `[T, H, D]`, k/v `[T, H_kv, D]` (H a multiple of H_kv) -> `[T, H, D]`. `kernel` as
    `choose_kernel` takes it; planned per call (a model plans once per forward instead)."""
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"query heads ({q.shape[1]}) must be a multiple of key/value heads ({k.shape[1]})")
    kernel = choose_kernel(kernel, q.device, q.dtype, q.shape[-1])
    if kernel == "sdpa":
        lengths = None if torch.compiler.is_compiling() else _lengths(cu_seqlens, q.shape[0])
        return sdpa_causal_attention(q, k, v, cu_seqlens, lengths, scale)
    return PackedAttention.plan(cu_seqlens, q.shape[0], kernel)(q, k, v, scale)


def _bounds(cu_seqlens: torch.Tensor, num_tokens: int) -> list[int]:
    """`cu_seqlens` on the host, with the trailing padding tokens as one more sequence (they
    attend among themselves, as in the dense mask)."""
    bounds = cu_seqlens.tolist()
    return [*bounds, num_tokens] if bounds[-1] < num_tokens else bounds


def _lengths(cu_seqlens: torch.Tensor, num_tokens: int) -> list[int]:
    return [b - a for a, b in itertools.pairwise(_bounds(cu_seqlens, num_tokens))]


def sdpa_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                          lengths: list[int] | None, scale: float | None) -> torch.Tensor:
    """The `sdpa` kernel: padded when `lengths` (with the trailing segment) are known and
    B * L_max^2 <= T^2, else one SDPA under the dense document mask (the only form under compile,
    where the lengths are not read)."""
    num_tokens, num_heads = q.shape[0], q.shape[1]
    if lengths is not None:
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

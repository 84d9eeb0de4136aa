"""Helpers for packed variable-length batches described by `cu_seqlens`.

`cu_seqlens` holds cumulative sequence lengths `[0, l0, l0+l1, ...]` (`[B+1]`). Everything here
stays on the tensors' device and avoids host syncs, so it is safe inside CUDA graphs / compile.
"""

from __future__ import annotations

import torch


def sequence_ids(cu_seqlens: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """Index of the sequence each token belongs to (`[T]` int64); tokens past `cu_seqlens[-1]` get B."""
    tokens = torch.arange(num_tokens, device=cu_seqlens.device)
    return torch.searchsorted(cu_seqlens[1:].to(torch.int64).contiguous(), tokens, right=True)


def positions_from_cu_seqlens(cu_seqlens: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """Positions restarting at 0 at every sequence start (`[T]` int64)."""
    tokens = torch.arange(num_tokens, device=cu_seqlens.device)
    seq_ids = sequence_ids(cu_seqlens, num_tokens).clamp(max=cu_seqlens.numel() - 2)
    return tokens - cu_seqlens.to(torch.int64)[seq_ids]

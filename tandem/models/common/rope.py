"""Rotary position embedding (HF "rotate half" layout) driven by explicit per-token positions.

Packed batches carry several sequences in one token dimension, so positions are an input rather
than an implicit `arange` (see `packing.positions_from_cu_seqlens`).
"""

from __future__ import annotations

import torch
from torch import nn


class RotaryEmbedding(nn.Module):
    """Produces (cos, sin) of shape `[T, head_dim]` for given positions.

    The inverse frequencies are recomputed per call instead of kept in a buffer: it costs
    head_dim/2 elements, and it means meta-device construction, `to_empty` and parameter-only
    state dicts never leave the model with garbage frequencies.
    """

    def __init__(self, head_dim: int, theta: float):
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"rotary head_dim must be even, got {head_dim}")
        self.head_dim = head_dim
        self.theta = theta

    def inv_freq(self, device: torch.device) -> torch.Tensor:
        exponents = torch.arange(0, self.head_dim, 2, dtype=torch.float32, device=device) / self.head_dim
        return 1.0 / (self.theta**exponents)

    @torch.no_grad()
    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        # Angles in float32 (large positions times small frequencies need the mantissa), then cast to
        # the activation dtype, as HF does.
        freqs = positions.to(torch.float32)[:, None] * self.inv_freq(positions.device)[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, theta={self.theta}"


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_emb(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate `x [T, heads, head_dim]` with `cos/sin [T, head_dim]`."""
    cos, sin = cos[:, None, :], sin[:, None, :]
    return x * cos + _rotate_half(x) * sin

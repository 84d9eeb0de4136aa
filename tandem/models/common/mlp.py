"""SwiGLU feed-forward block: w2(silu(w1 x) * w3 x)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tandem.models.common.lora import adapted


class SwiGLU(nn.Module):
    """w1 = gate projection, w3 = up projection, w2 = down projection (torchtitan naming); each
    with its low-rank adapter when `lora` holds one (`tandem.models.common.lora`)."""

    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.silu(adapted(self, "w1", x)) * adapted(self, "w3", x)
        return adapted(self, "w2", h)

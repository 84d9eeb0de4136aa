"""Copying many tensors at once, for the paths that move weights while other threads wait."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def copy_all(dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor]) -> None:
    """`dst.copy_(src)` for each pair (casting, across devices), in ONE call that releases the GIL
    for all of it: a Python loop of copies retakes the GIL after each tensor, and a thread waiting
    for it (e.g. one announcing or broadcasting the previous bucket) can then wait milliseconds."""
    if len(dsts) != len(srcs):
        raise ValueError(f"copy_all needs as many destinations as sources, got {len(dsts)} and {len(srcs)}")
    if dsts:
        torch._foreach_copy_(list(dsts), list(srcs))

"""Per-block `torch.compile`: transformer blocks share one structure, so a single compiled graph
serves them all, and FSDP's per-block collectives stay outside the compiled regions."""

from __future__ import annotations

from collections.abc import Mapping

from torch import nn


def apply_compile(blocks: Mapping[str, nn.Module], dynamic: bool = True) -> None:
    """Compile each block in place (`nn.Module.compile` keeps parameter names unchanged).
    `dynamic=True` because packed micro-batches change the token count every call."""
    for block in blocks.values():
        block.compile(dynamic=dynamic)

"""Activation checkpointing of transformer blocks, keeping parameter names unchanged.

`checkpoint_wrapper` would insert a `_checkpoint_wrapped_module.` level into every parameter name,
which the HF name mapping, DCP keys and weight export would then all have to strip. Replacing the
block's bound `forward` with a checkpointed call keeps the module tree as it is, and FSDP hooks
(which run in `__call__`, outside `forward`) still wrap the recompute.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import nn
from torch.utils.checkpoint import checkpoint


def checkpoint_module(module: nn.Module) -> None:
    """Recompute `module`'s forward during backward instead of keeping its activations."""
    inner = module.forward

    def forward(*args: Any, **kwargs: Any) -> Any:
        # Non-reentrant: works with keyword args, autograd-inside-forward and torch.compile.
        return checkpoint(inner, *args, use_reentrant=False, **kwargs)

    module.forward = forward  # type: ignore[method-assign]


def apply_activation_checkpointing(blocks: Mapping[str, nn.Module], mode: str, every: int = 1) -> list[str]:
    """Checkpoint `blocks` (in order): all for `full`, every `every`-th one for `selective`
    (blocks 0, every, 2*every, ...). Returns the names of the checkpointed blocks."""
    if mode == "none":
        return []
    if mode not in ("full", "selective"):
        raise ValueError(f"unknown activation checkpointing mode {mode!r}")
    step = 1 if mode == "full" else every
    chosen = [name for i, name in enumerate(blocks) if i % step == 0]
    for name in chosen:
        checkpoint_module(blocks[name])
    return chosen

"""Activation checkpointing of transformer blocks (`apply_activation_checkpointing`), keeping
parameter names unchanged: a block's bound `forward` is replaced by a checkpointed call, so HF name
mapping, DCP keys and weight export see the same module tree. Recomputation replays the first
pass's RNG state, so a recompute of a stochastic op equals the original."""

from __future__ import annotations

from collections.abc import Mapping
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

_aten = torch.ops.aten


def _attention_kernels() -> set[Any]:
    """The packed-attention kernels of CUDA (`tandem.models.common.attention`) where torch has them:
    flash varlen's op and FlexAttention's higher-order op."""
    found: set[Any] = set()
    try:
        import torch.nn.attention.varlen

        found.add(torch.ops.torch_attn._varlen_attn.default)
    except (ImportError, AttributeError):
        pass
    try:
        from torch._higher_order_ops.flex_attention import flex_attention

        found.add(flex_attention)
    except ImportError:
        pass
    return found


# Outputs kept by op-level selective checkpointing: the ops whose recompute would cost a matmul.
SAVED_OPS = frozenset({
    _aten.mm.default, _aten.addmm.default, _aten.bmm.default, _aten.linear.default,
    _aten._scaled_dot_product_flash_attention.default, _aten._scaled_dot_product_efficient_attention.default,
    _aten._scaled_dot_product_cudnn_attention.default, _aten._scaled_dot_product_flash_attention_for_cpu.default,
    *_attention_kernels(),
})


def _save_expensive_ops(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def checkpoint_module(module: nn.Module, op_level: bool = False) -> None:
    """Recompute `module`'s forward during backward instead of keeping its activations; with
    `op_level`, keep the outputs of `SAVED_OPS` and recompute only the rest."""
    inner = module.forward
    extra: dict[str, Any] = {}
    if op_level:
        extra["context_fn"] = partial(create_selective_checkpoint_contexts, _save_expensive_ops)

    def forward(*args: Any, **kwargs: Any) -> Any:
        # Non-reentrant: works with keyword args, autograd-inside-forward and torch.compile.
        return checkpoint(inner, *args, use_reentrant=False, preserve_rng_state=True, **extra, **kwargs)

    # Not `checkpoint_wrapper`: it adds a `_checkpoint_wrapped_module.` level to every parameter name.
    # FSDP's hooks run in `__call__`, outside `forward`, so they still wrap the recompute.
    module.forward = forward  # type: ignore[method-assign]


def apply_activation_checkpointing(blocks: Mapping[str, nn.Module], mode: str, every: int = 1,
                                   selective: str = "layer", memory_budget: float = 0.5) -> list[str]:
    """Checkpoint `blocks` (in order) as `mode` says: `full` (every block), `selective` with
    `selective="layer"` (every `every`-th layer: blocks named by layer index count by it) or `"op"` (every block, keeping `SAVED_OPS` outputs),
    or `memory_budget` (no wrapping: torch.compile's min-cut partitioner keeps `memory_budget` of
    the activations). Returns the names of the checkpointed blocks (none for `memory_budget`)."""
    if mode == "none":
        return []
    if mode == "memory_budget":
        import torch._functorch.config as functorch_config

        functorch_config.activation_memory_budget = memory_budget
        return []
    if mode not in ("full", "selective"):
        raise ValueError(f"unknown activation checkpointing mode {mode!r}")
    if selective not in ("layer", "op"):
        raise ValueError(f"unknown selective checkpointing option {selective!r}")
    op_level = mode == "selective" and selective == "op"
    step = every if mode == "selective" and not op_level else 1
    # Counted by layer index where blocks are named by it (a pipeline stage holds some layers of
    # the model): the same layers are checkpointed whatever the layout.
    chosen = [name for i, name in enumerate(blocks) if (int(name) if name.isdigit() else i) % step == 0]
    for name in chosen:
        checkpoint_module(blocks[name], op_level=op_level)
    return chosen

"""Activation checkpointing of transformer blocks (`apply_activation_checkpointing`), keeping
parameter names unchanged: a block's bound `forward` is replaced by a checkpointed call, so HF name
mapping, DCP keys and weight export see the same module tree. Recomputation replays the first
pass's RNG state, so a recompute of a stochastic op equals the original. With `debug`
(`actor.parallelize.ac_debug`) each checkpointed block logs what its forward saves and what its
backward recomputes (`BlockDebug`)."""

from __future__ import annotations

import contextlib
import logging
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from functools import partial
from typing import Any

import torch
from torch import nn
from torch._higher_order_ops.flex_attention import flex_attention
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import (
    SAC_IGNORED_OPS,
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

_aten = torch.ops.aten
log = logging.getLogger(__name__)


# Outputs kept by op-level selective checkpointing: the ops whose recompute would cost a matmul,
# attention included (on CUDA also FlexAttention's higher-order op, and flash varlen's ops of the
# torch_attn namespace, matched by namespace: importing torch.nn.attention.varlen to name them
# costs ~0.4 s at every trainer start, and only a varlen plan needs it).
SAVED_OPS = frozenset({
    _aten.mm.default, _aten.addmm.default, _aten.bmm.default, _aten.linear.default,
    _aten._scaled_dot_product_flash_attention.default, _aten._scaled_dot_product_efficient_attention.default,
    _aten._scaled_dot_product_cudnn_attention.default, _aten._scaled_dot_product_flash_attention_for_cpu.default,
    flex_attention,
})
VARLEN_NAMESPACE = "torch_attn"


def _save_expensive_ops(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    saved = op in SAVED_OPS or getattr(op, "namespace", None) == VARLEN_NAMESPACE
    return CheckpointPolicy.MUST_SAVE if saved else CheckpointPolicy.PREFER_RECOMPUTE


def checkpoint_module(module: nn.Module, op_level: bool = False, debug: BlockDebug | None = None) -> None:
    """Recompute `module`'s forward during backward instead of keeping its activations; with
    `op_level`, keep the outputs of `SAVED_OPS` and recompute only the rest. `debug` logs, per
    call, what the forward saved and what the backward recomputed."""
    inner = module.forward
    policy = _save_expensive_ops if op_level else None
    extra: dict[str, Any] = {}
    if debug is not None:
        extra["context_fn"] = partial(debug.contexts, policy)
    elif policy is not None:
        extra["context_fn"] = partial(create_selective_checkpoint_contexts, policy)

    def forward(*args: Any, **kwargs: Any) -> Any:
        # Non-reentrant: works with keyword args, autograd-inside-forward and torch.compile.
        return checkpoint(inner, *args, use_reentrant=False, preserve_rng_state=True, **extra, **kwargs)

    # Not `checkpoint_wrapper`: it adds a `_checkpoint_wrapped_module.` level to every parameter name.
    # FSDP's hooks run in `__call__`, outside `forward`, so they still wrap the recompute.
    module.forward = forward  # type: ignore[method-assign]


def _op_name(op: Any) -> str:
    return str(op).removesuffix(".default")


def _describe(ops: Counter[str], most: int = 8) -> str:
    """The most frequent op kinds with their counts, e.g. 'aten.mm x7, aten.add.Tensor x2'."""
    if not ops:
        return "none"
    shown = ", ".join(f"{name} x{n}" for name, n in ops.most_common(most))
    rest = len(ops) - most
    return f"{shown}, and {rest} more kinds" if rest > 0 else shown


class _OpRecorder(TorchDispatchMode):
    """Counts the aten ops that reach it (the ops SAC itself ignores, such as detach, left out)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func not in SAC_IGNORED_OPS:
            self.ops[_op_name(func)] += 1
        return func(*args, **(kwargs or {}))


class BlockDebug:
    """What one checkpointed block saves and recomputes (`actor.parallelize.ac_debug`), logged at
    INFO when a forward or a backward recompute of the block ends, whenever the line differs from
    the block's previous one of that phase (so a steady run logs each block twice).

    Forward: the ops whose outputs the selective policy saved (op-level), and the ops left to be
    recomputed; full and layer-level checkpointing save no op output (only the block's inputs).
    Backward: the ops that actually ran again, counted below torch's selective-checkpoint cache
    (outputs served from it are not recomputed; torch stops a recompute early once it has every
    tensor backward needs, so the count can be below the forward's)."""

    def __init__(self, name: str, kind: str) -> None:
        self.name, self.kind = name, kind
        self._last: dict[str, str] = {}

    def contexts(self, policy: Callable[..., CheckpointPolicy] | None) -> tuple[Any, Any]:
        """`checkpoint`'s `context_fn`: (forward, recompute) context managers for one call."""
        if policy is None:
            forward_ops, recomputed = _OpRecorder(), _OpRecorder()
            return (self._logged(forward_ops, lambda: self._forward_line(Counter(), forward_ops.ops)),
                    self._logged(recomputed, lambda: self._backward_line(recomputed.ops)))
        saved: Counter[str] = Counter()
        dropped: Counter[str] = Counter()

        def recording(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
            decision = policy(ctx, op, *args, **kwargs)
            keep = decision in (CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_SAVE)
            (saved if keep else dropped)[_op_name(op)] += 1
            return decision

        caching, cached = create_selective_checkpoint_contexts(recording)
        recomputed = _OpRecorder()
        return (self._logged(caching, lambda: self._forward_line(saved, dropped)),
                self._logged(_entered(recomputed, cached), lambda: self._backward_line(recomputed.ops)))

    @contextlib.contextmanager
    def _logged(self, inner: Any, line: Callable[[], tuple[str, str]]) -> Iterator[None]:
        try:
            with inner:
                yield
        finally:  # also after torch stops a recompute early (it raises out of the context)
            phase, text = line()
            if self._last.get(phase) != text:
                self._last[phase] = text
                log.info("ac_debug %s (%s) %s: %s", self.name, self.kind, phase, text)

    def _forward_line(self, saved: Counter[str], dropped: Counter[str]) -> tuple[str, str]:
        kept = (f"saved the outputs of {saved.total()} ops ({_describe(saved)})" if saved
                else "saved no op output (only the block's inputs)")
        return "forward", f"{kept}; {dropped.total()} ops left to recompute ({_describe(dropped)})"

    def _backward_line(self, recomputed: Counter[str]) -> tuple[str, str]:
        return "backward", f"recomputed {recomputed.total()} ops ({_describe(recomputed)})"


@contextlib.contextmanager
def _entered(outer: Any, inner: Any) -> Iterator[None]:
    """`inner` on top of `outer`: a dispatch mode entered later sees an op first, so `outer` sees
    only what `inner` runs (for torch's SAC cache: the recomputed ops, not those it serves)."""
    with outer, inner:
        yield


def apply_activation_checkpointing(blocks: Mapping[str, nn.Module], mode: str, every: int = 1,
                                   selective: str = "layer", memory_budget: float = 0.5,
                                   debug: bool = False, prefix: str = "layers.") -> list[str]:
    """Checkpoint `blocks` (in order) as `mode` says: `full` (every block), `selective` with
    `selective="layer"` (every `every`-th layer: blocks named by layer index count by it) or `"op"` (every block, keeping `SAVED_OPS` outputs),
    or `memory_budget` (no wrapping: torch.compile's min-cut partitioner keeps `memory_budget` of
    the activations). Returns the names of the checkpointed blocks (none for `memory_budget`).
    `debug`: log which blocks are checkpointed and, per block, what each call saves and recomputes
    (`BlockDebug`; blocks are named `prefix` + key)."""
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
    kind = "full" if mode == "full" else f"{'op' if op_level else 'layer'}-level selective"
    if debug:
        kept = [f"{prefix}{name}" for name in blocks if name not in chosen]
        log.info("ac_debug %s checkpointing: %d of %d blocks recomputed in backward (%s)%s", kind, len(chosen),
                 len(blocks), ", ".join(f"{prefix}{name}" for name in chosen),
                 f"; activations kept, nothing recomputed: {', '.join(kept)}" if kept else "")
    for name in chosen:
        checkpoint_module(blocks[name], op_level=op_level,
                          debug=BlockDebug(f"{prefix}{name}", kind) if debug else None)
    return chosen

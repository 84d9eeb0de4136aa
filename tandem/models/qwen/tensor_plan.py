"""Tensor-parallel plan of the Qwen dense models (DTensor `parallelize_module`; `apply_tensor_parallel`).

Megatron layout with sequence parallelism on the flat `[T, dim]` stream (dim 0): `wq wk wv`, `w1 w3`
column-parallel, `wo`, `w2` row-parallel, block norms sequence-parallel; the embedding is
row-parallel (vocab-sharded, tied embeddings stay one parameter), the final norm runs replicated so
the hidden states come back whole, and the output head returns each rank's vocabulary slice.
Callers must know: `T` is padded to `token_multiple`, and Qwen3's `q_norm` / `k_norm` gradients are
partial, listed in `TensorParallelInfo.partial_grad_params` for the trainer to sum over the TP group.
Details: docs/training.md, "Tensor parallelism"."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from tandem.parallel.tensor_parallel import TensorParallelInfo, check_divides

SEQ = Shard(0)  # the token dim of a flat [T, dim] activation


def _block_plan(moe: bool) -> dict:
    """The plan of one block; a MoE block's feed-forward is the expert plan's (`expert_plan`): here
    only its norm, which leaves the tokens sequence-sharded."""
    plan = {
        "attention_norm": SequenceParallel(sequence_dim=0),
        # Attention(x, rope, cu_seqlens, attn): only x is a sharded activation.
        "attention": PrepareModuleInput(
            input_layouts=(SEQ, None, None, None),
            desired_input_layouts=(Replicate(), None, None, None),
            use_local_output=True,
        ),
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=SEQ),
        "ffn_norm": SequenceParallel(sequence_dim=0),
        "feed_forward": PrepareModuleInput(
            input_layouts=(SEQ,), desired_input_layouts=(Replicate(),), use_local_output=True
        ),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w3": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(output_layouts=SEQ),
    }
    return {k: v for k, v in plan.items() if not k.startswith("feed_forward")} if moe else plan


# Which way each adapted linear is split (the plan above); its adapter follows it.
_COLWISE = ("attention.wq", "attention.wk", "attention.wv", "feed_forward.w1", "feed_forward.w3")
_ROWWISE = ("attention.wo", "feed_forward.w2")


def _adapter_plan(block: nn.Module) -> dict:
    """The plan of a block's LoRA adapters (`tandem.models.common.lora`), shaped by their linear's:
    column-parallel `W`: `a` whole on every rank (its input is the whole activation; its gradient
    is whole too, summed by `b`'s input layout), `b` column-parallel like `W`. Row-parallel `W`:
    `a` row-parallel with the tokens reduce-scattered like `W`'s output, `b` replicated over
    sequence-parallel tokens (its gradient summed over them by DTensor, as a norm's)."""
    plan: dict = {}
    for base in (*_COLWISE, *_ROWWISE):
        parent, attr = base.split(".")
        adapters = getattr(getattr(block, parent, None), "lora", None)
        if adapters is None or attr not in adapters:
            continue
        if base in _COLWISE:
            plan[f"{parent}.lora.{attr}.b"] = ColwiseParallel()
        else:
            plan[f"{parent}.lora.{attr}.a"] = RowwiseParallel(output_layouts=SEQ)
            plan[f"{parent}.lora.{attr}.b"] = SequenceParallel(sequence_dim=0, use_local_output=True)
    return plan


def _own_storage(module: nn.Module, inputs: tuple, output: torch.Tensor) -> torch.Tensor:
    """The embedding's local output is a view of its DTensor's local tensor; a compiled block that
    receives such a view returns no gradient through it (measured with torch 2.13: the embedding's
    gradient was 0). A copy (`[T / tp, dim]`, small) gives the first block a tensor of its own."""
    del module, inputs
    return output.clone()


def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh) -> TensorParallelInfo:
    """Shard `model` (a `QwenModel`, on any device, typically meta) over the 1-D `tp_mesh` in
    place; sets and returns `model.tensor_parallel`. Raises `ConfigError` when tp does not divide
    the key/value heads (each rank must own whole KV heads with their query heads).
    MoE blocks: attention and norms as in a dense block; their router and experts are laid out by
    `expert_plan.apply_expert_parallel` (after this), which adds its partial-gradient parameters
    to `model.tensor_parallel`."""
    tp = tp_mesh.size()
    args = model.args
    check_divides(tp, num_key_value_heads=args.n_kv_heads, num_attention_heads=args.n_heads,
                  intermediate_size=args.intermediate_size)
    if args.o_bias:
        raise NotImplementedError("tensor parallelism of a Qwen model with an output-projection bias "
                                  "(attention_bias with Qwen3) is not implemented")
    top = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=SEQ),
        "norm": PrepareModuleInput(input_layouts=(SEQ,), desired_input_layouts=(Replicate(),),
                                   use_local_output=True),
        "output": ColwiseParallel(input_layouts=Replicate(), output_layouts=Shard(-1), use_local_output=True),
    }
    # A pipeline rank's part of the model lacks the modules other stages hold (None).
    frozen = {name for name, p in model.named_parameters() if not p.requires_grad}  # LoRA's base weights
    parallelize_module(model, tp_mesh, {k: v for k, v in top.items() if getattr(model, k) is not None})
    if model.tok_embeddings is not None:
        model.tok_embeddings.register_forward_hook(_own_storage)
    partial: list[str] = []
    for key, block in model.layers.items():
        parallelize_module(block, tp_mesh, _block_plan(getattr(block, "moe", None) is not None) | _adapter_plan(block))
        for norm in ("q_norm", "k_norm"):
            if getattr(block.attention, norm) is not None:
                partial.append(f"layers.{key}.attention.{norm}.weight")
    # parallelize_module gives each module its own new parameter: tie the (identically sharded)
    # embedding and output head again. torch's SequenceParallel makes a norm's new parameter
    # trainable whatever the old one was (torch 2.13): a frozen weight stays frozen.
    model.tie_weights()
    for name, p in model.named_parameters():
        if name in frozen:
            p.requires_grad_(False)
    model.token_multiple = tp
    info = TensorParallelInfo(tp_mesh, args.vocab_size, tuple(partial))
    model.tensor_parallel = info
    return info

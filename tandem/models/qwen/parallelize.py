"""Parallelism plan for Qwen models (`parallelize_qwen`), in a fixed order, each step assuming the
previous ones: tensor parallel (`tensor_plan`), then expert / expert-tensor parallel of MoE blocks
(`expert_plan`) -> activation checkpointing -> per-block `torch.compile` (after AC, so checkpointed
regions are traced too) -> FSDP2 per block, then the root (last: it wraps whatever the block has
become; under EP a block's experts are their own unit first, over the expert FSDP mesh).
See docs/training.md, "Parallelism"."""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from tandem.config.alloc import TRAINER_DIMS_PENDING
from tandem.errors import ConfigError
from tandem.models.qwen.expert_plan import apply_expert_parallel, check_expert_layout
from tandem.models.qwen.tensor_plan import apply_tensor_parallel
from tandem.parallel import (
    ParallelDims,
    ParallelizeConfig,
    apply_activation_checkpointing,
    apply_compile,
    apply_fsdp,
    fsdp_needed,
)
from tandem.parallel.context_parallel import check_heads


def parallelize_qwen(
    model: nn.Module,
    parallel_dims: ParallelDims,
    *,
    mesh: DeviceMesh | None = None,
    config: ParallelizeConfig | None = None,
    root: nn.Module | None = None,
    param_dtype: torch.dtype = torch.float32,
    reduce_dtype: torch.dtype = torch.float32,
    stages: list[nn.Module] | None = None,
) -> nn.Module:
    """Apply the layout of `parallel_dims` to `model` (on the meta device) in place; return it.

    `mesh`: from `parallel_dims.build_mesh` (default: built here for the current accelerator, or
    CPU). `root` is the module whose forward the trainer calls (e.g. a wrapper computing log-probs
    around `model`); FSDP's root unit goes there so that its forward hooks fire. Default: `model`.
    `param_dtype` / `reduce_dtype`: FSDP's compute and gradient-reduction dtypes.
    `stages` (pipeline parallelism): `model` is one pipeline rank's part (`split_qwen`) and these
    are its stage modules (`QwenStage`, each with its own `layers`); the model-wide steps (tensor
    parallel) apply to `model`, then activation checkpointing, compile and FSDP to each stage, which
    is its own FSDP root (`root` is not used).
    """
    config = config or ParallelizeConfig()
    pending = [name for name in TRAINER_DIMS_PENDING if getattr(parallel_dims.sizes, name) > 1]
    if pending:
        raise NotImplementedError(f"{', '.join(pending)} > 1 is not implemented for Qwen yet; got {parallel_dims.sizes}")
    if parallel_dims.sizes.cp > 1:
        # Context parallelism changes no module: the trainer's forward splits the tokens and passes
        # Ulysses attention through the model's `attn` hook. Its heads must split over the cp ranks.
        check_heads(model.args.n_heads, model.args.n_kv_heads, parallel_dims.sizes.cp)
    sizes = parallel_dims.sizes
    moe = getattr(model.args, "num_experts", 0) > 0
    if (sizes.ep > 1 or sizes.etp > 1) and not moe:
        raise ConfigError(f"expert parallelism (ep={sizes.ep}, etp={sizes.etp}) needs a mixture-of-experts model; "
                          f"{model.args.model_type} has no experts: drop 'e' (and the ffn part) from actor.backend")
    if moe:
        check_expert_layout(model.args, sizes.ep, sizes.etp)
    if mesh is None:
        accelerator = torch.accelerator.current_accelerator()
        mesh = parallel_dims.build_mesh(accelerator.type if accelerator is not None else "cpu")
    # Options left to the device (compile, activation checkpointing) are chosen here, where the
    # layout is known; the engine has chosen them already and logged why (`for_device`).
    config, _ = config.for_device(mesh.device_type, tp=sizes.tp, pp=sizes.pp)
    config.check("parallelize.")
    tp_mesh = parallel_dims.tp_mesh(mesh)
    if tp_mesh is not None:
        config.check_layout(tp_mesh.size(), "parallelize.")
        info = apply_tensor_parallel(model, tp_mesh)  # the whole model, or a pipeline rank's part
    ep_mesh = parallel_dims.ep_mesh(mesh)
    if moe:
        partial_grads = apply_expert_parallel(model, ep_mesh=ep_mesh, tp_mesh=tp_mesh,
                                              expert_tp=parallel_dims.etp_enabled,
                                              experts_mesh=parallel_dims.experts_mesh(mesh),
                                              ep_folds_tp=parallel_dims.ep_folds_tp)
        if partial_grads:
            model.tensor_parallel = replace(info, partial_grad_params=(*info.partial_grad_params, *partial_grads))
    expert_units = {}
    if ep_mesh is not None:  # experts are their own FSDP units, over the ranks holding the same experts
        expert_units = {k: b.moe.experts for k, b in model.layers.items() if getattr(b, "moe", None) is not None}
    pipelined = stages is not None
    for part, part_root in ((s, s) for s in stages) if pipelined else [(model, root or model)]:
        blocks = part.layers
        apply_activation_checkpointing(blocks, config.activation_checkpoint, config.ac_every, config.ac_selective,
                                       config.ac_memory_budget, debug=config.ac_debug)
        if config.compile:
            # Under TP, `dynamic=True` (every dim symbolic) makes inductor fail compiling the backward
            # (`mul expected 2 arguments, got 3` on a `2 * s0 * s1` size, torch 2.13); automatic dynamic
            # shapes compile static first, then mark only the dims that change (the token count).
            apply_compile(blocks, dynamic=None if tp_mesh is not None else True)
        if fsdp_needed(parallel_dims.world_size, param_dtype, config, pipelined):
            apply_fsdp(part_root, blocks, parallel_dims.fsdp_mesh(mesh), config, param_dtype=param_dtype,
                       reduce_dtype=reduce_dtype, pipelined=pipelined,
                       inner={k: expert_units[k] for k in blocks if k in expert_units},
                       inner_mesh=parallel_dims.expert_fsdp_mesh(mesh) if expert_units else None)
    return model

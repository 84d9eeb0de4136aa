"""Parallelism plan for Qwen dense models.

Order (fixed; each step assumes the previous ones):
1. tensor parallel (later issue) — changes the shapes of the block's linear layers;
2. activation checkpointing — wraps each chosen block's forward in a recompute;
3. per-block `torch.compile` — compiles the (checkpointed) block, so AC regions are traced too;
4. FSDP2 — per block, then the root; it must be last, because it wraps whatever the block has
   become and registers its all-gather / reduce-scatter hooks around it.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from tandem.config.alloc import TRAINER_DIMS_PENDING
from tandem.parallel import (
    ParallelDims,
    ParallelizeConfig,
    apply_activation_checkpointing,
    apply_compile,
    apply_fsdp,
)


def parallelize_qwen(
    model: nn.Module,
    parallel_dims: ParallelDims,
    *,
    mesh: DeviceMesh | None = None,
    config: ParallelizeConfig | None = None,
    root: nn.Module | None = None,
    param_dtype: torch.dtype = torch.float32,
    reduce_dtype: torch.dtype = torch.float32,
) -> nn.Module:
    """Apply the layout of `parallel_dims` to `model` (on the meta device) in place; return it.

    `mesh`: from `parallel_dims.build_mesh` (default: built here for the current accelerator, or
    CPU). `root` is the module whose forward the trainer calls (e.g. a wrapper computing log-probs
    around `model`); FSDP's root unit goes there so that its forward hooks fire. Default: `model`.
    `param_dtype` / `reduce_dtype`: FSDP's compute and gradient-reduction dtypes.
    Under pipeline parallelism it is called once per stage (`tandem.models.qwen.pipeline.QwenStage`,
    which has the model's `layers`), with the stage as `model` and `root`.
    """
    config = config or ParallelizeConfig()
    pending = [name for name in TRAINER_DIMS_PENDING if getattr(parallel_dims.sizes, name) > 1]
    if pending:
        raise NotImplementedError(f"{', '.join(pending)} > 1 is not implemented for Qwen yet; got {parallel_dims.sizes}")
    if mesh is None:
        accelerator = torch.accelerator.current_accelerator()
        mesh = parallel_dims.build_mesh(accelerator.type if accelerator is not None else "cpu")
    blocks = model.layers
    apply_activation_checkpointing(blocks, config.activation_checkpoint, config.ac_every, config.ac_selective,
                                   config.ac_memory_budget)
    if config.compile:
        apply_compile(blocks)
    apply_fsdp(root if root is not None else model, blocks, parallel_dims.fsdp_mesh(mesh), config,
               param_dtype=param_dtype, reduce_dtype=reduce_dtype, pipelined=parallel_dims.sizes.pp > 1)
    return model

"""FSDP2 (`fully_shard`) per transformer block plus the root.

Every block is its own FSDP unit (its parameters are all-gathered just before its forward and
freed after), and the root unit holds what is left: embeddings, final norm and output head. Tied
embedding/output weights are one parameter, so they must land in one unit: both live in the root,
which shards them once.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)

from tandem.parallel.config import ParallelizeConfig


def _reshard_block(policy: str, is_last: bool, pipelined: bool = False) -> bool:
    if policy == "always":
        return True
    if policy == "never" or pipelined:
        # Under pipeline parallelism every micro-batch's forward would gather the block again.
        return False
    # "default": the last block's parameters are needed again first thing in backward.
    return not is_last


def apply_fsdp(
    root: nn.Module,
    blocks: Mapping[str, nn.Module],
    mesh: DeviceMesh,
    config: ParallelizeConfig,
    param_dtype: torch.dtype = torch.float32,
    reduce_dtype: torch.dtype = torch.float32,
    pipelined: bool = False,
    inner: Mapping[str, nn.Module] | None = None,
    inner_mesh: DeviceMesh | None = None,
) -> list[FSDPModule]:
    """Shard each of `blocks`, then `root` (the module whose forward is the training entry point,
    which must contain the blocks). Returns the FSDP modules, root last. FSDP casts parameters to
    `param_dtype` for compute (master weights keep theirs) and reduces gradients in `reduce_dtype`.
    `pipelined`: `root` is a pipeline stage (the "default" reshard policy then means never).
    `config.offload_params` keeps parameters, gradients and optimizer state in host memory (an
    accelerator run only: `ParallelizeConfig.check_device`).
    `inner[name]`: a module inside block `name` that is its own unit, sharded first over
    `inner_mesh` (a MoE block's experts, sharded over the ranks that hold the same experts), with
    the block's reshard policy."""
    mp_policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    offload = CPUOffloadPolicy() if config.offload_params else OffloadPolicy()
    units: list[FSDPModule] = []
    names = list(blocks)
    for i, name in enumerate(names):
        reshard = _reshard_block(config.reshard_after_forward, i == len(names) - 1, pipelined)
        if inner and name in inner:
            fully_shard(inner[name], mesh=inner_mesh, mp_policy=mp_policy, reshard_after_forward=reshard,
                        offload_policy=offload)
            units.append(inner[name])  # type: ignore[arg-type]
        fully_shard(blocks[name], mesh=mesh, mp_policy=mp_policy, reshard_after_forward=reshard,
                    offload_policy=offload)
        units.append(blocks[name])  # type: ignore[arg-type]
    # The root keeps its parameters gathered from forward to backward (FSDP2 never reshards the
    # root after forward), so the head computed inside the root's forward can use them freely.
    # A pipeline stage is its own root: it keeps its parameters between micro-batches unless "always".
    extra = {"reshard_after_forward": config.reshard_after_forward == "always"} if pipelined else {}
    fully_shard(root, mesh=mesh, mp_policy=mp_policy, offload_policy=offload, **extra)
    units.append(root)  # type: ignore[arg-type]
    return units


def fsdp_needed(world_size: int, param_dtype: torch.dtype, config: ParallelizeConfig, pipelined: bool) -> bool:
    """False for one rank computing in float32 (the master weights' dtype) with nothing offloaded
    and no pipeline: FSDP2 would shard over one rank and cast nothing, while its hooks and DTensor
    dispatch were a third of the tiny preset's `train_batch` (33 -> 22 ms without them). The model
    then stays plain; any other layout or dtype is sharded."""
    return world_size > 1 or param_dtype != torch.float32 or config.offload_params or pipelined


def fsdp_units(module: nn.Module) -> list[FSDPModule]:
    return [m for m in module.modules() if isinstance(m, FSDPModule)]

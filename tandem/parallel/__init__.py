"""Parallelism building blocks: parallel dims and device meshes, FSDP2, activation checkpointing,
per-block compile. Model families combine them in their `parallelize` function."""

from tandem.lazy import lazy_attributes

# Loaded on first use: `ParallelizeConfig` is part of the run config, whose loading (`show-config`,
# the checks before a run) must not import torch.distributed.
_LAZY = {
    "apply_activation_checkpointing": "tandem.parallel.activation_checkpoint",
    "checkpoint_module": "tandem.parallel.activation_checkpoint",
    "apply_compile": "tandem.parallel.compile",
    "AC_MODES": "tandem.parallel.config", "RESHARD_POLICIES": "tandem.parallel.config",
    "ParallelizeConfig": "tandem.parallel.config",
    "MESH_ORDER": "tandem.parallel.dims", "ParallelDims": "tandem.parallel.dims",
    "apply_fsdp": "tandem.parallel.fsdp", "fsdp_needed": "tandem.parallel.fsdp", "fsdp_units": "tandem.parallel.fsdp",
}

__getattr__ = lazy_attributes(__name__, _LAZY)

__all__ = [
    "AC_MODES",
    "MESH_ORDER",
    "RESHARD_POLICIES",
    "ParallelDims",
    "ParallelizeConfig",
    "apply_activation_checkpointing",
    "apply_compile",
    "apply_fsdp",
    "checkpoint_module",
    "fsdp_needed",
    "fsdp_units",
]

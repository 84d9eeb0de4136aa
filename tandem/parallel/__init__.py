"""Parallelism building blocks: parallel dims and device meshes, FSDP2, activation checkpointing,
per-block compile. Model families combine them in their `parallelize` function."""

from tandem.parallel.activation_checkpoint import apply_activation_checkpointing, checkpoint_module
from tandem.parallel.compile import apply_compile
from tandem.parallel.config import AC_MODES, RESHARD_POLICIES, ParallelizeConfig
from tandem.parallel.dims import MESH_ORDER, ParallelDims
from tandem.parallel.fsdp import apply_fsdp, fsdp_units

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
    "fsdp_units",
]

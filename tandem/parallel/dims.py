"""Parallel dimensions of a training job and the device mesh they describe.

The mesh is laid out outermost to innermost as `pp, dp_replicate, dp_shard, cp, tp` (torchtitan's
order: the innermost dims get the fastest links, so TP stays inside a node and PP spans nodes).
Each parallelize step takes its submesh from here (`fsdp_mesh`, `tp_mesh`, `cp_mesh`,
`pp_mesh`); batch-level reductions use `dp_group`. Which dims a model family can apply is its
`parallelize` function's business (it refuses the others by name).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from tandem.config.parallel_sizes import ParallelSizes
from tandem.errors import ConfigError

MESH_ORDER = ("pp", "dp_replicate", "dp_shard", "cp", "tp")


@dataclass(frozen=True)
class ParallelDims:
    """A job's `ParallelSizes` with its data-parallel size split into `dp_replicate` (HSDP
    replicas) x `dp_shard` (FSDP shards). Raises `ConfigError` when `dp_replicate` does not divide
    `sizes.dp`, or `ep` does not divide `dp_shard * cp` (experts are sharded over a slice of those
    ranks; `ep` adds none).
    """

    sizes: ParallelSizes
    dp_replicate: int = 1

    def __post_init__(self) -> None:
        if self.dp_replicate < 1 or self.sizes.dp % self.dp_replicate:
            raise ConfigError(f"dp_replicate ({self.dp_replicate}) must be >= 1 and divide the data-parallel "
                              f"size {self.sizes.dp}")
        if (self.dp_shard * self.sizes.cp) % self.sizes.ep:
            raise ConfigError(f"ep ({self.sizes.ep}) must divide dp_shard * cp ({self.dp_shard * self.sizes.cp})")

    @classmethod
    def data_parallel(cls, world_size: int, dp_replicate: int = 1) -> ParallelDims:
        """Every rank a data-parallel rank."""
        return cls(ParallelSizes(dp=world_size), dp_replicate)

    @classmethod
    def for_world(cls, world_size: int, *, tp: int = 1, pp: int = 1, cp: int = 1,
                  dp_replicate: int = 1) -> ParallelDims:
        """The layout of `world_size` ranks with these model-parallel sizes; the rest is data
        parallelism. Raises `ConfigError` when tp * pp * cp does not divide the world."""
        model_parallel = tp * pp * cp
        if model_parallel < 1 or world_size % model_parallel:
            raise ConfigError(f"tp * pp * cp = {tp} * {pp} * {cp} must divide the trainer's world size {world_size}")
        return cls(ParallelSizes(dp=world_size // model_parallel, tp=tp, pp=pp, cp=cp), dp_replicate)

    @property
    def dp_shard(self) -> int:
        return self.sizes.dp // self.dp_replicate

    @property
    def dp_size(self) -> int:
        """Ranks that see different data (the loss is normalised over them)."""
        return self.sizes.dp

    @property
    def world_size(self) -> int:
        return self.sizes.world_size

    @property
    def fsdp_enabled(self) -> bool:
        return self.dp_shard * self.sizes.cp > 1

    @property
    def only_data_parallel(self) -> bool:
        return self.sizes.only_data_parallel

    def mesh_sizes(self) -> dict[str, int]:
        """Size of every mesh dimension, in `MESH_ORDER`."""
        s = self.sizes
        return {"pp": s.pp, "dp_replicate": self.dp_replicate, "dp_shard": self.dp_shard, "cp": s.cp, "tp": s.tp}

    def build_mesh(self, device_type: str) -> DeviceMesh:
        """A mesh over all ranks with a named dim for every size > 1 (`dp_shard` always, so
        FSDP has a mesh even on one rank), plus the flattened dims the layout needs: `dp`
        (dp_replicate x dp_shard) when HSDP replicates, `dp_shard_cp` when cp > 1. Needs an
        initialised default process group; every rank must call it (it is collective)."""
        dims = [(n, s) for n, s in self.mesh_sizes().items() if s > 1 or n == "dp_shard"]
        mesh = init_device_mesh(device_type, tuple(s for _, s in dims), mesh_dim_names=tuple(n for n, _ in dims))
        if self.dp_replicate > 1:
            mesh["dp_replicate", "dp_shard"]._flatten("dp")
        if self.sizes.cp > 1:
            mesh["dp_shard", "cp"]._flatten("dp_shard_cp")
        return mesh

    def fsdp_mesh(self, mesh: DeviceMesh) -> DeviceMesh:
        """The mesh FSDP shards parameters over and reduces gradients over: `dp_shard`, flattened
        with `cp` when cp > 1 (CP ranks hold the same parameters and see different tokens, so
        their gradients are summed like data-parallel ones); (`dp_replicate`, that) for HSDP."""
        shard = "dp_shard_cp" if self.sizes.cp > 1 else "dp_shard"
        if self.dp_replicate > 1:
            return mesh["dp_replicate", shard]
        return mesh[shard]

    def dp_mesh(self, mesh: DeviceMesh) -> DeviceMesh:
        """1-D mesh over the data-parallel ranks of this rank's TP/CP/PP position (the ranks that
        train on different shards of a batch)."""
        return mesh["dp"] if self.dp_replicate > 1 else mesh["dp_shard"]

    def dp_group(self, mesh: DeviceMesh) -> dist.ProcessGroup | None:
        """Process group over the data-parallel ranks (loss-token counts, micro-batch plans,
        stats); `None` (the default group) when every rank is a data-parallel rank."""
        if self.dp_size == self.world_size:
            return None
        return self.dp_mesh(mesh).get_group()

    def _submesh(self, mesh: DeviceMesh, name: str) -> DeviceMesh | None:
        return mesh[name] if self.mesh_sizes()[name] > 1 else None

    def tp_mesh(self, mesh: DeviceMesh) -> DeviceMesh | None:
        """The tensor-parallel submesh, or None without tensor parallelism."""
        return self._submesh(mesh, "tp")

    def cp_mesh(self, mesh: DeviceMesh) -> DeviceMesh | None:
        """The context-parallel submesh, or None without context parallelism."""
        return self._submesh(mesh, "cp")

    def pp_mesh(self, mesh: DeviceMesh) -> DeviceMesh | None:
        """The pipeline-parallel submesh, or None without pipeline parallelism."""
        return self._submesh(mesh, "pp")

    def describe(self) -> str:
        """`pp=.. dp_shard=.. dp_replicate=.. tp=.. cp=..`, what the engine logs at start."""
        m = self.mesh_sizes()
        return " ".join(f"{k}={m[k]}" for k in ("pp", "dp_shard", "dp_replicate", "tp", "cp"))

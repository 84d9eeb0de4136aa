"""Parallel dimensions of a training job and the device mesh they describe.

The mesh is laid out outermost to innermost as `pp, dp_replicate, dp_shard, cp, tp` (torchtitan's
order: the innermost dims get the fastest links, so TP stays inside a node and PP spans nodes).
Only data parallelism (FSDP2 sharding, optionally HSDP replication) is applied today; TP, PP, CP
and EP are validated and get mesh dims so that their parallelize steps can slot in later without
changing how meshes are built or looked up.
"""

from __future__ import annotations

from dataclasses import dataclass

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
        """Every rank a data-parallel rank (what the trainer applies today)."""
        return cls(ParallelSizes(dp=world_size), dp_replicate)

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
        FSDP has a mesh even on one rank). Needs an initialised default process group."""
        dims = [(n, s) for n, s in self.mesh_sizes().items() if s > 1 or n == "dp_shard"]
        return init_device_mesh(
            device_type, tuple(s for _, s in dims), mesh_dim_names=tuple(n for n, _ in dims)
        )

    def fsdp_mesh(self, mesh: DeviceMesh) -> DeviceMesh:
        """The mesh FSDP shards over: `dp_shard`, or (`dp_replicate`, `dp_shard`) for HSDP."""
        if self.sizes.cp > 1:
            raise NotImplementedError("context parallelism is not implemented yet (cp must be 1)")
        if self.dp_replicate > 1:
            return mesh["dp_replicate", "dp_shard"]
        return mesh["dp_shard"]

    def dp_group(self, mesh: DeviceMesh):  # -> ProcessGroup | None
        """Process group over the data-parallel ranks (for loss-token counts and micro-batch
        agreement). With data parallelism only that is every rank: `None`, the default group."""
        del mesh  # needed once tp/cp/pp ranks exist: the flattened dp_replicate x dp_shard dims
        if not self.only_data_parallel:
            raise NotImplementedError("tp / pp / cp / ep are not implemented yet; use data parallelism")
        return None

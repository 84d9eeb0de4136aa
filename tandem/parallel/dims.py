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

from tandem.errors import ConfigError

MESH_ORDER = ("pp", "dp_replicate", "dp_shard", "cp", "tp")


@dataclass
class ParallelDims:
    """Sizes per dimension; `dp_shard=-1` takes whatever the others leave of `world_size`.

    `ep` (expert parallel) does not add ranks: experts are sharded over a slice of the
    dp_shard x cp ranks, so it must divide their product.
    """

    dp_shard: int = -1
    dp_replicate: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    world_size: int = 1

    def __post_init__(self) -> None:
        for name in ("dp_replicate", "tp", "pp", "cp", "ep", "world_size"):
            if getattr(self, name) < 1:
                raise ConfigError(f"parallel dim {name} must be >= 1, got {getattr(self, name)}")
        others = self.dp_replicate * self.tp * self.pp * self.cp
        if self.dp_shard == -1:
            if self.world_size % others:
                raise ConfigError(
                    f"world size {self.world_size} is not divisible by dp_replicate*tp*pp*cp = {others}"
                )
            self.dp_shard = self.world_size // others
        if self.dp_shard < 1:
            raise ConfigError(f"parallel dim dp_shard must be >= 1 (or -1 to fill), got {self.dp_shard}")
        if others * self.dp_shard != self.world_size:
            raise ConfigError(
                f"dp_replicate({self.dp_replicate}) * dp_shard({self.dp_shard}) * cp({self.cp}) * "
                f"tp({self.tp}) * pp({self.pp}) = {others * self.dp_shard} != world size {self.world_size}"
            )
        if (self.dp_shard * self.cp) % self.ep:
            raise ConfigError(f"ep ({self.ep}) must divide dp_shard * cp ({self.dp_shard * self.cp})")

    @property
    def dp_size(self) -> int:
        """Ranks that see different data (the loss is normalised over them)."""
        return self.dp_replicate * self.dp_shard

    @property
    def fsdp_enabled(self) -> bool:
        return self.dp_shard * self.cp > 1

    @property
    def only_data_parallel(self) -> bool:
        return self.tp == self.pp == self.cp == self.ep == 1

    def sizes(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in MESH_ORDER}

    def build_mesh(self, device_type: str) -> DeviceMesh:
        """A mesh over all ranks with a named dim for every size > 1 (`dp_shard` always, so
        FSDP has a mesh even on one rank). Needs an initialised default process group."""
        dims = [(n, s) for n, s in self.sizes().items() if s > 1 or n == "dp_shard"]
        return init_device_mesh(
            device_type, tuple(s for _, s in dims), mesh_dim_names=tuple(n for n, _ in dims)
        )

    def fsdp_mesh(self, mesh: DeviceMesh) -> DeviceMesh:
        """The mesh FSDP shards over: `dp_shard`, or (`dp_replicate`, `dp_shard`) for HSDP."""
        if self.cp > 1:
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

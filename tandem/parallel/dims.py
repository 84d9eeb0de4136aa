"""Parallel dimensions of a training job (`ParallelDims`) and the device mesh they describe
(`build_mesh`), laid out outermost to innermost as `pp, dp_replicate, dp_shard, cp, tp`
(torchtitan's order: TP stays inside a node, PP spans nodes).

Each parallelize step takes its submesh from here (`fsdp_mesh`, `tp_mesh`, `cp_mesh`, `pp_mesh`;
for experts `ep_mesh`, `expert_fsdp_mesh`, `etp_mesh`); batch-level reductions use `dp_group`.
The ep ranks are carved out of `dp_shard x cp`, innermost (docs/parallelism.md, "Mixture-of-experts
layouts"). Which dims a model family applies is its `parallelize` function's business."""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from tandem.config.parallel_sizes import ParallelSizes, ep_layout_problem
from tandem.errors import ConfigError

MESH_ORDER = ("pp", "dp_replicate", "dp_shard", "cp", "tp")


@dataclass(frozen=True)
class ParallelDims:
    """A job's `ParallelSizes` with its data-parallel size split into `dp_replicate` (HSDP
    replicas) x `dp_shard` (FSDP shards). Raises `ConfigError` when `dp_replicate` does not divide
    `sizes.dp`, `etp` is neither 1 nor tp, or the ep ranks cannot be carved from the others
    (`ep_layout_problem`; `ep` adds no ranks).
    """

    sizes: ParallelSizes
    dp_replicate: int = 1

    def __post_init__(self) -> None:
        if self.dp_replicate < 1 or self.sizes.dp % self.dp_replicate:
            raise ConfigError(f"dp_replicate ({self.dp_replicate}) must be >= 1 and divide the data-parallel "
                              f"size {self.sizes.dp}")
        if self.sizes.etp not in (1, self.sizes.tp):
            raise ConfigError(f"etp ({self.sizes.etp}) must be 1 or tp ({self.sizes.tp}): experts are either whole "
                              "on each rank or tensor-parallel over the attention's TP group")
        problem = ep_layout_problem(self.dp_shard, self.sizes.cp, self.sizes.tp, self.sizes.ep, self.sizes.etp)
        if problem:
            raise ConfigError(problem)

    @classmethod
    def data_parallel(cls, world_size: int, dp_replicate: int = 1) -> ParallelDims:
        """Every rank a data-parallel rank."""
        return cls(ParallelSizes(dp=world_size), dp_replicate)

    @classmethod
    def for_world(cls, world_size: int, *, tp: int = 1, pp: int = 1, cp: int = 1, ep: int = 1, etp: int = 1,
                  dp_replicate: int = 1) -> ParallelDims:
        """The layout of `world_size` ranks with these model-parallel sizes; the rest is data
        parallelism (`ep`, `etp` add no ranks). Raises `ConfigError` when tp * pp * cp does not
        divide the world."""
        model_parallel = tp * pp * cp
        if model_parallel < 1 or world_size % model_parallel:
            raise ConfigError(f"tp * pp * cp = {tp} * {pp} * {cp} must divide the trainer's world size {world_size}")
        return cls(ParallelSizes(dp=world_size // model_parallel, tp=tp, pp=pp, cp=cp, ep=ep, etp=etp), dp_replicate)

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

    @property
    def ep_enabled(self) -> bool:
        return self.sizes.ep > 1

    @property
    def etp_enabled(self) -> bool:
        return self.sizes.etp > 1

    @property
    def ep_folds_tp(self) -> bool:
        """MoE parallel folding: the experts are split over the attention's TP ranks too."""
        return self.sizes.ep_folds_tp

    def mesh_sizes(self) -> dict[str, int]:
        """Size of every mesh dimension, in `MESH_ORDER`."""
        s = self.sizes
        return {"pp": s.pp, "dp_replicate": self.dp_replicate, "dp_shard": self.dp_shard, "cp": s.cp, "tp": s.tp}

    def build_mesh(self, device_type: str) -> DeviceMesh:
        """A mesh over all ranks with a named dim for every size > 1 (`dp_shard` always, so
        FSDP has a mesh even on one rank), plus the flattened dims the layout needs: `dp`
        (dp_replicate x dp_shard) when HSDP replicates, `dp_shard_cp` when cp > 1; under expert
        parallelism `dp_shard` is flattened from `dp_shard_mod_ep x dp_shard_in_ep`, and `ep` from
        `dp_shard_in_ep x cp` when cp > 1. Needs an
        initialised default process group; every rank must call it (it is collective)."""
        dims = [(n, s) for n, s in self.mesh_sizes().items() if s > 1 or n == "dp_shard"]
        if self.ep_enabled:  # dp_shard as dp_shard_mod_ep x dp_shard_in_ep (both kept, even of size 1)
            at = [n for n, _ in dims].index("dp_shard")
            in_ep = self.sizes.ep // (self.sizes.cp * (self.sizes.tp if self.ep_folds_tp else 1))
            dims[at: at + 1] = [("dp_shard_mod_ep", self.dp_shard // in_ep), ("dp_shard_in_ep", in_ep)]
        mesh = init_device_mesh(device_type, tuple(s for _, s in dims), mesh_dim_names=tuple(n for n, _ in dims))
        if self.ep_enabled:
            _flattened(mesh, self._base("dp_shard"), "dp_shard")
            if self.ep_folds_tp:
                _flattened(mesh, ("dp_shard_in_ep", *(("cp",) if self.sizes.cp > 1 else ()), "tp"), "ep")
            elif self.sizes.cp > 1:
                _flattened(mesh, ("dp_shard_in_ep", "cp"), "ep")
        if self.dp_replicate > 1:
            _flattened(mesh, self._base("dp_replicate", "dp_shard"), "dp")
        if self.sizes.cp > 1:
            _flattened(mesh, self._base("dp_shard", "cp"), "dp_shard_cp")
        return mesh

    def _base(self, *names: str) -> tuple[str, ...]:
        """The root mesh's own dims behind `names` (`dp_shard` is two dims under expert parallelism)."""
        split = {"dp_shard": ("dp_shard_mod_ep", "dp_shard_in_ep")} if self.ep_enabled else {}
        return tuple(d for n in names for d in split.get(n, (n,)))

    def _dp_shard(self, mesh: DeviceMesh) -> DeviceMesh:
        return _flattened(mesh, self._base("dp_shard"), "dp_shard") if self.ep_enabled else mesh["dp_shard"]

    def fsdp_mesh(self, mesh: DeviceMesh) -> DeviceMesh:
        """The mesh FSDP shards parameters over and reduces gradients over: `dp_shard`, flattened
        with `cp` when cp > 1 (CP ranks hold the same parameters and see different tokens, so
        their gradients are summed like data-parallel ones); (`dp_replicate`, that) for HSDP."""
        if self.sizes.cp == 1:
            if self.dp_replicate > 1:
                self._dp_shard(mesh)
                return mesh["dp_replicate", "dp_shard"]
            return self._dp_shard(mesh)
        if self.dp_replicate > 1:
            return mesh["dp_replicate", "dp_shard_cp"]
        return _flattened(mesh, self._base("dp_shard", "cp"), "dp_shard_cp")

    def dp_mesh(self, mesh: DeviceMesh) -> DeviceMesh:
        """1-D mesh over the data-parallel ranks of this rank's TP/CP/PP position (the ranks that
        train on different shards of a batch)."""
        if self.dp_replicate > 1:
            return _flattened(mesh, self._base("dp_replicate", "dp_shard"), "dp")
        return self._dp_shard(mesh)

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

    def _ep_dim(self) -> str | None:
        if not self.ep_enabled:
            return None
        return "ep" if self.sizes.cp > 1 or self.ep_folds_tp else "dp_shard_in_ep"

    def ep_mesh(self, mesh: DeviceMesh) -> DeviceMesh | None:
        """The 1-D mesh the experts are split over (`dp_shard_in_ep x cp`, and x tp when the
        experts fold over the TP ranks), or None without EP."""
        ep = self._ep_dim()
        return None if ep is None else mesh[ep]

    def etp_mesh(self, mesh: DeviceMesh) -> DeviceMesh | None:
        """The mesh each expert's hidden units are split over (the TP mesh), or None when etp == 1."""
        return self.tp_mesh(mesh) if self.etp_enabled else None

    def experts_mesh(self, mesh: DeviceMesh) -> DeviceMesh | None:
        """The mesh expert weights are DTensors on: `(ep, tp)` with EP and ETP, the ep or the TP
        mesh with one of them, None with neither."""
        ep = self._ep_dim()
        if ep is not None and self.etp_enabled:
            return mesh[ep, "tp"]
        return mesh[ep] if ep is not None else self.etp_mesh(mesh)

    def expert_fsdp_mesh(self, mesh: DeviceMesh) -> DeviceMesh:
        """The mesh FSDP shards the experts over and sums their gradients over: the data-parallel
        ranks holding the same experts, `dp_shard_mod_ep` (size 1 when ep = dp_shard * cp), with
        `dp_replicate` for HSDP. Without EP: `fsdp_mesh`."""
        if not self.ep_enabled:
            return self.fsdp_mesh(mesh)
        return mesh["dp_replicate", "dp_shard_mod_ep"] if self.dp_replicate > 1 else mesh["dp_shard_mod_ep"]

    def describe(self) -> str:
        """`pp=.. dp_shard=.. dp_replicate=.. tp=.. cp=..`, what the engine logs at start; with
        experts laid out (ep or etp > 1) also `ep=.. etp=.. edp=..`."""
        m = self.mesh_sizes()
        text = " ".join(f"{k}={m[k]}" for k in ("pp", "dp_shard", "dp_replicate", "tp", "cp"))
        if self.ep_enabled or self.etp_enabled:
            text += f" ep={self.sizes.ep} etp={self.sizes.etp} edp={self.sizes.edp}"
        return text


def _flattened(mesh: DeviceMesh, dims: tuple[str, ...], name: str) -> DeviceMesh:
    """The 1-D mesh `name` over `dims` of the root `mesh`: made by the first call (collective: every
    rank builds its group), the same object afterwards (torch keeps it on the root mesh). Asked
    for this way instead of slicing `mesh[name]`, which torch deprecates for flattened dims."""
    return mesh[dims]._flatten(name)

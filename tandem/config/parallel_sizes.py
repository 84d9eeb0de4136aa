"""`ParallelSizes`: the one representation of a job's parallel sizes.

The allocation grammar produces it (`Component.sizes`) and the trainer builds its device mesh
from it (`tandem.parallel.ParallelDims`). Expert parallelism adds no ranks: experts are laid out
over the same `world_size` devices, `ep * etp * pp` per expert replica, `edp` replicas.
"""

from __future__ import annotations

from dataclasses import dataclass

from tandem.errors import ConfigError

SIZE_NAMES = ("dp", "tp", "pp", "cp", "ep", "etp")


@dataclass(frozen=True)
class ParallelSizes:
    """Data, tensor, pipeline, context, expert and expert-tensor parallel sizes (absent = 1).

    `edp` (expert data parallel size) is derived when left at -1: `dp` without experts (ep = etp
    = 1), else `world_size / (ep * etp * pp)`. Given explicitly (the hybrid attn/ffn layout), it
    must satisfy `edp * ep * etp * pp == world_size`. Raises `ConfigError` for sizes below 1 or
    an expert layout that does not tile the devices.
    """

    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    etp: int = 1
    edp: int = -1

    def __post_init__(self) -> None:
        for name in SIZE_NAMES:
            if getattr(self, name) < 1:
                raise ConfigError(f"parallel size {name} must be >= 1, got {getattr(self, name)}")
        group = self.ep * self.etp * self.pp
        if self.edp == -1:
            if self.ep == self.etp == 1:
                object.__setattr__(self, "edp", self.dp)
                return
            if self.world_size % group:
                raise ConfigError(f"ep*etp*pp = {group} must divide the world size {self.world_size}")
            object.__setattr__(self, "edp", self.world_size // group)
        elif self.edp < 1 or self.edp * group != self.world_size:
            raise ConfigError(f"edp*ep*etp*pp = {self.edp}*{group} must equal the world size {self.world_size}")

    @property
    def world_size(self) -> int:
        """Devices of the job: dp * tp * pp * cp."""
        return self.dp * self.tp * self.pp * self.cp

    @property
    def only_data_parallel(self) -> bool:
        return self.tp == self.pp == self.cp == self.ep == self.etp == 1

    def coords(self, rank: int) -> dict[str, int]:
        """Where global `rank` sits on the trainer's mesh, laid out outermost to innermost as
        `pp, dp, cp, tp` (the device mesh's order, `dp` = replicate x shard flattened): e.g. with
        d2t2, ranks 0 and 1 are the two TP ranks of data-parallel rank 0."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside a world of {self.world_size}")
        out = {}
        for name, size in (("tp", self.tp), ("cp", self.cp), ("dp", self.dp), ("pp", self.pp)):
            rank, out[name] = divmod(rank, size)
        return {name: out[name] for name in ("pp", "dp", "cp", "tp")}

    @property
    def ep_folds_tp(self) -> bool:
        """MoE parallel folding: the experts are split over the attention's TP ranks too (etp 1, ep
        a multiple of cp x tp; `ep_layout_problem`)."""
        return self.ep > 1 and self.etp == 1 and self.tp > 1 and self.ep % (self.cp * self.tp) == 0

    def expert_coords(self, rank: int) -> dict[str, int]:
        """Where global `rank` sits on the experts' view of the same ranks, `pp, edp, ep, etp`: its
        `ep` index is which 1/ep of every MoE layer's experts it holds, `etp` which 1/etp of each
        expert's hidden units. The ep ranks are carved innermost first (`ep_layout_problem`): with
        folding from tp, cp, then dp; otherwise from cp, then dp (tp being etp, or whole experts
        replicated over the TP ranks, counted in edp)."""
        c = self.coords(rank)
        if self.ep_folds_tp or self.tp == 1:
            local = (c["dp"] * self.cp + c["cp"]) * self.tp + c["tp"]
            return {"pp": c["pp"], "edp": local // self.ep, "ep": local % self.ep, "etp": 0}
        local = c["dp"] * self.cp + c["cp"]
        if self.etp > 1:
            return {"pp": c["pp"], "edp": local // self.ep, "ep": local % self.ep, "etp": c["tp"]}
        return {"pp": c["pp"], "edp": local // self.ep * self.tp + c["tp"], "ep": local % self.ep, "etp": 0}

    def dp_rank(self, rank: int) -> int:
        """The data-parallel rank of global `rank`: which shard of a batch it trains on (its TP,
        CP and PP peers train on the same one)."""
        return self.coords(rank)["dp"]


def ep_layout_problem(dp_shard: int, cp: int, tp: int, ep: int, etp: int) -> str | None:
    """Why `ep` experts ranks cannot be carved from these ranks, or None. Innermost first, as
    Megatron's MoE parallel folding: with etp = 1 and ep a multiple of cp x tp, the ep ranks span
    every TP and CP rank of a data-parallel rank and `ep / (cp tp)` of the data-parallel ranks;
    otherwise (etp = tp, or ep not such a multiple) they span the CP ranks and `ep / cp` of the
    data-parallel ones, each TP rank holding whole experts (etp 1) or its share of each (etp = tp)."""
    if ep == 1:
        return None
    if etp == 1 and tp > 1 and ep % (cp * tp) == 0:
        if dp_shard % (ep // (cp * tp)):
            return (f"ep ({ep}) spans the {cp * tp} context- and tensor-parallel ranks of a data-parallel rank and "
                    f"{ep // (cp * tp)} data-parallel ranks, more than the {dp_shard} there are")
        return None
    if (dp_shard * cp) % ep or ep % cp:
        folding = f", or a multiple of cp*tp = {cp * tp} with etp=1 (experts folded over the TP ranks)" if tp > 1 else ""
        return (f"ep ({ep}) must divide dp_shard * cp = {dp_shard * cp} and be a multiple of cp = {cp} (the experts "
                f"are split over data- and context-parallel ranks){folding}")
    return None

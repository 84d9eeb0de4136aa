"""`TrainController`: the controller's handle on one trainer group, one method per RPC.

    trainer = TrainController.start(scheduler, "archon:d2", device="cpu")
    trainer.initialize(engine_config)
    critic = trainer.colocated("critic")        # a second engine on the same ranks

Control plane only: it names `TrainWorker` methods (never strings) over a `WorkerGroup` and imports
neither engine nor model code. Every call runs on every rank; methods that take `shards` give rank
r `shards[r]` (one per data-parallel rank: TP, CP and PP peers get the same shard). Errors are the
RPC layer's (`RemoteError`, `WorkerCrashedError`, ...). See docs/launch.md, "The trainer ranks"."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from tandem.config.parallel_sizes import ParallelSizes
from tandem.launch.rpc import WorkerGroup
from tandem.train.worker import ROLES, EngineInfo, EngineRole, RankInfo, TrainWorker

if TYPE_CHECKING:
    import torch

    from tandem.algo.config import AlgoConfig
    from tandem.config.alloc import Component
    from tandem.data.batch import SequenceBatch
    from tandem.fleet.interface import Fleet
    from tandem.launch.scheduler import Scheduler
    from tandem.train.config import TrainEngineConfig
    from tandem.train.engine import TokenOutputs
    from tandem.weights.meta import WeightUpdateMeta
    from tandem.weights.report import UpdateReport

WORKER_MODULE = "tandem.train.worker"


class TrainController:
    """Drives the `role` engine of the ranks of `group`, which serve `TrainWorker` (or a subclass)."""

    def __init__(self, group: WorkerGroup, role: EngineRole = "actor"):
        if role not in ROLES:
            raise ValueError(f"role {role!r} is not one of {ROLES}")
        self.group = group
        self.role: EngineRole = role
        self.sizes = ParallelSizes(dp=group.world_size)  # the engine's layout, set by `initialize`

    @classmethod
    def start(cls, scheduler: Scheduler, alloc: Component | str | int, *, name: str = "actor",
              device: str = "cpu", backend: str | None = None, env: Mapping[str, str] | None = None,
              timeout_s: float = 180.0, module: str = WORKER_MODULE, role: EngineRole = "actor") -> TrainController:
        """Start the group's processes (`python -m module`, default `tandem.train.worker`) and
        return the controller of their `role` engine once every rank has joined the process group
        and is connected. The engine is not built yet: call `initialize`."""
        args = ["--device", device, *(["--backend", backend] if backend else [])]
        return cls(scheduler.start_workers(alloc, module, args=args, name=name, device=device,
                                           timeout_s=timeout_s, env=env), role)

    def colocated(self, role: EngineRole) -> TrainController:
        """A controller of another engine on the same ranks (it shares the processes: shutting
        either down ends both)."""
        return type(self)(self.group, role)

    @property
    def world_size(self) -> int:
        return self.group.world_size

    @property
    def dp_size(self) -> int:
        """Data-parallel ranks: a batch is split into this many shards."""
        return self.sizes.dp

    def _per_rank(self, shards: Sequence[SequenceBatch]) -> list[tuple[SequenceBatch]]:
        """Each rank's arguments: the shard of its data-parallel rank."""
        if len(shards) != self.dp_size:
            raise ValueError(f"{len(shards)} shards for {self.dp_size} data-parallel ranks")
        return [(shards[self.sizes.dp_rank(r)],) for r in range(self.world_size)]

    def _dp_leaders(self) -> list[int]:
        """The lowest rank of each data-parallel rank's group, in data-parallel order."""
        leaders: dict[int, int] = {}
        for r in range(self.world_size):
            leaders.setdefault(self.sizes.dp_rank(r), r)
        return [leaders[d] for d in range(self.dp_size)]

    def ping(self) -> list[RankInfo]:
        return self.group.call(TrainWorker.ping)

    def initialize(self, config: TrainEngineConfig) -> list[EngineInfo]:
        """Build this role's engine on every rank, laid out as `config`'s tp, pp and cp say."""
        model_parallel = config.tp * config.pp * config.cp
        if self.world_size % model_parallel:
            raise ValueError(f"tp * pp * cp = {model_parallel} does not divide the {self.world_size} trainer ranks")
        self.sizes = ParallelSizes(dp=self.world_size // model_parallel, tp=config.tp, pp=config.pp, cp=config.cp)
        return self.group.call(TrainWorker.initialize, config, role=self.role)

    # ---------------------------------------------------------------------------- training

    def compute_logprobs(self, shards: Sequence[SequenceBatch], temperature: float = 1.0,
                         loss_tokens_only: bool = False) -> list[TokenOutputs]:
        """Each data-parallel rank's `TokenOutputs` of its shard, in data-parallel order (an actor's
        or a reference's)."""
        results = self.group.call_per_rank(TrainWorker.compute_logprobs, self._per_rank(shards),
                                           {"temperature": temperature, "role": self.role,
                                            "loss_tokens_only": loss_tokens_only})
        return [results[r] for r in self._dp_leaders()]

    def compute_values(self, shards: Sequence[SequenceBatch]) -> list[list[torch.Tensor]]:
        """A critic's values of each data-parallel rank's shard at its loss tokens (prediction
        alignment, per sequence), in data-parallel order."""
        results = self.group.call_per_rank(TrainWorker.compute_values, self._per_rank(shards))
        return [results[r] for r in self._dp_leaders()]

    def value_update(self, shards: Sequence[SequenceBatch], algo: AlgoConfig, n_minibatches: int) -> dict[str, float]:
        """A critic's update on shards carrying `values` and `returns`; the `critic/*` stats."""
        return self.group.call_per_rank(TrainWorker.value_update, self._per_rank(shards),
                                        {"algo": algo, "n_minibatches": n_minibatches})[0]

    def ppo_update(self, shards: Sequence[SequenceBatch], algo: AlgoConfig, version: int, temperature: float,
                   n_minibatches: int) -> dict[str, float]:
        """One decoupled-PPO update (`TrainWorker.ppo_update`); the stats, reduced over ranks."""
        opts = {"algo": algo, "version": version, "temperature": temperature, "n_minibatches": n_minibatches}
        return self.group.call_per_rank(TrainWorker.ppo_update, self._per_rank(shards), opts)[0]

    def sft_step(self, shards: Sequence[SequenceBatch]) -> dict[str, float]:
        """One supervised step; the stats (loss and token counts are global, the same on every rank)."""
        return self.group.call_per_rank(TrainWorker.sft_step, self._per_rank(shards))[0]

    def preference_update(self, shards: Sequence[SequenceBatch]) -> dict[str, float]:
        """One Bradley-Terry step of a critic on shards of whole preference pairs
        (`TrainWorker.preference_update`); the `reward/*` stats, over every rank."""
        return self.group.call_per_rank(TrainWorker.preference_update, self._per_rank(shards))[0]

    def preference_scores(self, shards: Sequence[SequenceBatch]) -> dict[str, float]:
        """The `reward/*` stats of a critic's scores of shards of preference pairs, no update."""
        return self.group.call_per_rank(TrainWorker.preference_scores, self._per_rank(shards))[0]

    # ---------------------------------------------------------------------------- checkpoints

    def save_hf(self, path: str, *, tokenizer_dir: str | None = None, dtype: torch.dtype | None = None,
                overwrite: bool = False) -> str:
        """HF directory of this role's current weights; its path."""
        return self.group.call(TrainWorker.save_hf, path, tokenizer_dir=tokenizer_dir, dtype=dtype,
                               overwrite=overwrite, role=self.role)[0]

    def save(self, path: str) -> str:
        """This role's state (weights, optimizer, step, LR schedule) under `path`."""
        return self.group.call(TrainWorker.save, path, role=self.role)[0]

    def load(self, path: str) -> int:
        """Resume this role's engine from `save`; the step it was saved at."""
        return self.group.call(TrainWorker.load, path, role=self.role)[0]

    # ---------------------------------------------------------------------------- weight sync

    def init_weight_update(self, meta: WeightUpdateMeta, fleet: Fleet, *, verify: bool = False) -> None:
        """Prepare weight updates to the servers; only rank 0 gets `fleet`."""
        fleets = [fleet, *([None] * (self.world_size - 1))]
        self.group.call_per_rank(TrainWorker.init_weight_update, [(meta, f) for f in fleets], {"verify": verify})

    def update_weights(self, version: int) -> UpdateReport:
        """Move the current weights to every server as `version`; rank 0's report."""
        return self.group.call(TrainWorker.update_weights, version)[0]

    def close_weight_update(self) -> None:
        self.group.call(TrainWorker.close_weight_update)

    def shutdown(self, timeout_s: float = 5.0) -> bool:
        """Ask every rank to leave and wait for the processes (`WorkerGroup.shutdown`)."""
        return self.group.shutdown(timeout_s)

    def __repr__(self) -> str:
        return f"TrainController({self.group!r}, role={self.role!r})"

"""One trainer rank: a process of the SPMD trainer group, driven by RPC from a `TrainController`.

    python -m tandem.train.worker --device cpu [--backend gloo] [--pg-timeout 1800]

Started by a scheduler (`start_workers(alloc, "tandem.train.worker")`), it joins the
torch.distributed group (gloo on CPU, NCCL on CUDA, unless --backend) and serves a `TrainWorker`:
every public method is an RPC the controller calls on every rank, with typed arguments. A rank
holds one engine per role (`actor`; for PPO a `critic` and the frozen `reference`), sharing the
process group, each with its own mesh. Importing it is cheap (no engine or model code): the
controller imports it to name the methods."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Literal, NoReturn

from tandem.launch.rpc_server import ExitAfterReply, serve_from_environment

if TYPE_CHECKING:
    import torch

    from tandem.algo.config import AlgoConfig
    from tandem.data.batch import SequenceBatch
    from tandem.fleet.interface import Fleet
    from tandem.train.config import TrainEngineConfig
    from tandem.train.engine import TokenOutputs, TrainEngine
    from tandem.weights.meta import WeightUpdateMeta
    from tandem.weights.report import UpdateReport
    from tandem.weights.updater import WeightUpdater


EngineRole = Literal["actor", "critic", "reference"]
ROLES: tuple[EngineRole, ...] = ("actor", "critic", "reference")


@dataclass(frozen=True)
class RankInfo:
    """What `ping` says about a rank."""

    rank: int
    world_size: int
    pid: int
    device: str
    backend: str
    initialized: bool  # the actor's engine is built


@dataclass(frozen=True)
class EngineInfo:
    """What `initialize` says about a rank's new engine."""

    rank: int
    step: int
    local_params: int  # elements of the model's parameters (every stage's under pipeline parallelism)


class TrainWorker:
    """What the controller can ask a trainer rank to do. Methods marked collective must run on
    every rank, in the same order (a `TrainController` always calls them so)."""

    def __init__(self, rank: int, world_size: int, device: torch.device, backend: str):
        self.rank, self.world_size, self.device, self.backend = rank, world_size, device, backend
        self.engines: dict[EngineRole, TrainEngine] = {}
        self.updater: WeightUpdater | None = None

    def __str__(self) -> str:
        return f"trainer rank {self.rank}/{self.world_size}, {self.backend} on {self.device}"

    # ---------------------------------------------------------------------------- basics

    def ping(self) -> RankInfo:
        return RankInfo(self.rank, self.world_size, os.getpid(), str(self.device), self.backend,
                        "actor" in self.engines)

    def initialize(self, config: TrainEngineConfig, role: EngineRole = "actor") -> EngineInfo:
        """Build the `TrainEngine` of `role` (a critic's holds a value model). Collective."""
        from tandem.train.engine import TrainEngine  # ranks only

        if role not in ROLES:
            raise ValueError(f"role {role!r} is not one of {ROLES}")
        if role in self.engines:
            raise RuntimeError(f"the {role}'s engine is initialised already")
        engine = self.engines[role] = TrainEngine(config, head="value" if role == "critic" else "lm")
        return EngineInfo(self.rank, engine.step, engine.num_parameters())

    def _engine(self, role: EngineRole = "actor") -> TrainEngine:
        if role not in self.engines:
            raise RuntimeError(f"no {role} engine on this worker: call initialize(config, role={role!r}) first")
        return self.engines[role]

    def step(self, role: EngineRole = "actor") -> int:
        """Optimizer steps taken so far."""
        return int(self._engine(role).step)

    # ---------------------------------------------------------------------------- training

    def compute_logprobs(self, shard: SequenceBatch, temperature: float = 1.0, role: EngineRole = "actor",
                         loss_tokens_only: bool = False) -> TokenOutputs:
        """Logprobs and entropies of this rank's shard under the current weights of `role` (the
        actor or the reference). Collective."""
        return self._engine(role).forward_logprobs(shard, temperature=temperature, loss_tokens_only=loss_tokens_only)

    def compute_values(self, shard: SequenceBatch) -> list[torch.Tensor]:
        """The critic's values of this rank's shard at its loss tokens (`TrainEngine.forward_values`,
        prediction alignment). Collective."""
        return self._engine("critic").forward_values(shard, loss_tokens_only=True)

    def ppo_update(self, shard: SequenceBatch, algo: AlgoConfig, version: int, temperature: float,
                   n_minibatches: int) -> dict[str, float]:
        """Decoupled PPO on this rank's shard (`tandem.train.rl_step.ppo_update`): proximal
        logprobs with the weights of `version`, then `n_minibatches` optimizer steps. Stats are
        reduced over all ranks. Collective."""
        from tandem.train.rl_step import ppo_update  # ranks only

        return ppo_update(self._engine(), shard, algo, version, temperature, n_minibatches)

    def value_update(self, shard: SequenceBatch, algo: AlgoConfig, n_minibatches: int) -> dict[str, float]:
        """The critic's clipped-value-loss update on this rank's shard (`tandem.train.rl_step.value_update`);
        stats reduced over the critic's ranks. Collective."""
        from tandem.train.rl_step import value_update  # ranks only

        return value_update(self._engine("critic"), shard, algo, n_minibatches)

    def sft_step(self, shard: SequenceBatch) -> dict[str, float]:
        """One supervised optimizer step, loss on the shard's loss-mask tokens (the completion).
        Collective."""
        from tandem.train.losses import sft_loss  # ranks only

        return self._engine().train_batch(shard, sft_loss)

    def preference_update(self, shard: SequenceBatch) -> dict[str, float]:
        """One Bradley-Terry step of the critic's value model on this rank's preference pairs
        (`tandem.train.preference_step`); `reward/*` stats over every rank. Collective."""
        from tandem.train.preference_step import bradley_terry_update  # ranks only

        return bradley_terry_update(self._engine("critic"), shard)

    def preference_scores(self, shard: SequenceBatch) -> dict[str, float]:
        """The `reward/*` stats of the critic's scores of this rank's preference pairs, over every
        rank, with no update (a held-out evaluation). Collective."""
        from tandem.train.preference_step import pair_scores, pair_stats  # ranks only

        engine = self._engine("critic")
        return pair_stats(pair_scores(engine, shard), engine)

    # ---------------------------------------------------------------------------- checkpoints

    def save_hf(self, path: str, *, tokenizer_dir: str | None = None, dtype: torch.dtype | None = None,
                overwrite: bool = False, role: EngineRole = "actor") -> str:
        """HF directory of `role`'s current weights (`TrainEngine.save_hf`; a critic's: the
        `...ForTokenClassification` layout). Collective."""
        return str(self._engine(role).save_hf(path, tokenizer_dir=tokenizer_dir, dtype=dtype, overwrite=overwrite))

    def save(self, path: str, role: EngineRole = "actor") -> str:
        """The weights, optimizer, step and LR schedule of `role`'s engine (DCP). Collective."""
        return str(self._engine(role).save_state(path))

    def load(self, path: str, role: EngineRole = "actor") -> int:
        """Resume `role`'s engine from `save`; returns the step. Collective."""
        engine = self._engine(role)
        engine.load_state(path)
        return int(engine.step)

    # ---------------------------------------------------------------------------- weight sync

    def init_weight_update(self, meta: WeightUpdateMeta, fleet: Fleet | None, **opts: Any) -> None:
        """Prepare weight updates to the servers: `fleet` is rank 0's way to them (None on the
        other ranks), `opts` are `WeightUpdater`'s keyword options (`verify`, ...). Collective."""
        from tandem.weights.updater import WeightUpdater  # ranks only

        self.close_weight_update()
        engine = self._engine()
        if meta.lora_alpha is not None and engine.lora is None:
            raise ValueError("the weight update carries LoRA adapters (lora_alpha) but this trainer trains none")
        engine.sync_adapters = meta.lora_alpha is not None  # else a LoRA trainer exports merged weights
        self.updater = WeightUpdater(engine, fleet, meta, **opts)

    def update_weights(self, version: int) -> UpdateReport:
        """Move the current weights to every server as `version`. Collective."""
        if self.updater is None:
            raise RuntimeError("call init_weight_update(meta, fleet) first")
        return self.updater.update(version)

    def close_weight_update(self) -> None:
        if self.updater is not None:
            updater, self.updater = self.updater, None
            updater.close()

    def shutdown(self) -> ExitAfterReply:
        """Reply (rank, pid, step), then the process leaves (`os._exit(0)`)."""
        with contextlib.suppress(Exception):
            self.close_weight_update()
        step = int(self.engines["actor"].step) if "actor" in self.engines else None
        return ExitAfterReply({"rank": self.rank, "pid": os.getpid(), "step": step})


def main(argv: list[str] | None = None, worker_type: type[TrainWorker] = TrainWorker) -> NoReturn:
    """Join this rank's process group, then serve a `worker_type` (a subclass may add methods)."""
    parser = argparse.ArgumentParser(prog="python -m tandem.train.worker")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (LOCAL_RANK picks the GPU)")
    parser.add_argument("--backend", default=None, help="torch.distributed backend (default: gloo on CPU, nccl on CUDA)")
    parser.add_argument("--pg-timeout", type=float, default=1800.0, help="seconds for rendezvous and each collective")
    args = parser.parse_args(argv)
    # The engine's own records (e.g. "parallel dims: ...", pipeline warnings) go to the rank's log.
    logging.basicConfig(level=logging.INFO,
                        format=f"%(asctime)s trainer-rank{os.environ.get('RANK', '?')} %(name)s %(levelname)s %(message)s")

    def build() -> TrainWorker:
        from tandem.train.dist import default_backend, init_from_env, resolve_device  # ranks only

        device = resolve_device(args.device)
        backend = args.backend or default_backend(device)
        init_from_env(backend, timedelta(seconds=args.pg_timeout))
        return worker_type(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), device, backend)

    serve_from_environment(build)


if __name__ == "__main__":
    # Serve the classes of the imported module, not of this `__main__` copy: results pickle by
    # module name, and the controller knows them as `tandem.train.worker.*`.
    from tandem.train.worker import main as imported_main

    imported_main()

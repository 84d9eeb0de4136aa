"""The models a run trains on the trainer ranks, and what one step asks of them.

    models = start_models(cfg, scheduler)          # actor; critic and reference when the algorithm has them
    stats = models.update(tb, cfg, version)        # reference logprobs, values, advantages, updates

The actor is always there. PPO's critic (`algo.ppo.use_critic`) is a value model with its own
engine: on the actor's ranks (data parallel over all of them) or on its own (`critic.backend`).
The reference (`algo.ppo.kl_ctl > 0`) is a frozen copy of the policy in the actor's layout, on the
actor's ranks. The controller side only: every model is a `TrainController`.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass
from pathlib import Path

from tandem.algo.losses import OLD_VALUES, REF_LOGPROBS, to_input_alignment
from tandem.config.alloc import parse_allocation_of_kind
from tandem.config.lora import LoRAConfig
from tandem.data.batch import SequenceBatch
from tandem.launch.process_scheduler import ProcessScheduler
from tandem.rl.batch import TrainingBatch, add_training_advantages
from tandem.rl.checkpoints import CRITIC
from tandem.rl.cluster import start_workers
from tandem.rl.config import TandemConfig
from tandem.rl.dispatch import model_hidden_size, split_for_ranks
from tandem.train.config import TrainEngineConfig
from tandem.train.controller import TrainController

logger = logging.getLogger("tandem.run")


@dataclass
class TrainerModels:
    actor: TrainController
    critic: TrainController | None = None
    reference: TrainController | None = None
    hidden_size: int | None = None  # the actor's, for the FLOP cost of the split (the critic has its architecture)

    def update(self, tb: TrainingBatch, cfg: TandemConfig, version: int) -> dict[str, float]:
        """One training step on `tb` (`version`: the actor's weight version before it): the
        reference's logprobs and the critic's values of the batch, the advantages (on the
        controller: `add_training_advantages`), then the actor's PPO update and the critic's."""
        shards, stats = split_for_ranks(tb.batch, self.actor.dp_size, cfg.actor.balance, self.hidden_size)
        if self.reference is not None:
            outputs = self.reference.compute_logprobs(shards, cfg.gen.temperature, loss_tokens_only=True)
            _attach(shards, [o.logprobs for o in outputs], REF_LOGPROBS)
        critic_shards: list[SequenceBatch] = []
        if self.critic is not None:
            critic_shards = shards
            if self.critic.dp_size != self.actor.dp_size:
                critic_shards = split_for_ranks(tb.batch, self.critic.dp_size, cfg.actor.balance, self.hidden_size)[0]
            _attach(critic_shards, self.critic.compute_values(critic_shards), OLD_VALUES)
        stats.update(add_training_advantages(tb, cfg.algo))
        stats.update(self.actor.ppo_update(shards, cfg.algo, version, cfg.gen.temperature, cfg.train.n_minibatches))
        if self.critic is not None:
            stats.update(self.critic.value_update(critic_shards, cfg.algo, cfg.train.n_minibatches))
        return stats

    def save(self, trainer_dir: Path) -> None:
        """The actor's state under `trainer_dir`, the critic's next to it (`../critic`)."""
        self.actor.save(str(trainer_dir))
        if self.critic is not None:
            self.critic.save(str(trainer_dir.parent / CRITIC))

    def load(self, trainer_dir: Path) -> None:
        """Resume what `save` wrote (the reference is rebuilt from its path: it never changes)."""
        if self.critic is not None and not (trainer_dir.parent / CRITIC).is_dir():
            raise FileNotFoundError(f"{trainer_dir.parent} holds no critic ({CRITIC}/): it was saved by a run without "
                                    "one, so this run (algo.ppo.use_critic) cannot resume from it")
        self.actor.load(str(trainer_dir))
        if self.critic is not None:
            self.critic.load(str(trainer_dir.parent / CRITIC))


def _attach(shards: list[SequenceBatch], per_shard: list[list], key: str) -> None:
    """Store each sequence's prediction-aligned tensor under `key` in input alignment (the shards'
    sequences are the batch's, so the whole batch gets them)."""
    for shard, tensors in zip(shards, per_shard, strict=True):
        for seq, tensor in zip(shard.seqs, tensors, strict=True):
            seq[key] = to_input_alignment(tensor.float())


def critic_engine_config(cfg: TandemConfig) -> TrainEngineConfig:
    """The critic's engine: the actor's options (dtype, micro-batching, parallelize), its own path
    and optimizer, data parallel over its ranks, live MoE routing; it trains whole (no LoRA)."""
    return dataclasses.replace(cfg.actor, path=cfg.critic.path or cfg.actor.path, optimizer=cfg.critic.optimizer,
                               tp=1, pp=1, cp=1, ep=1, etp=1, dp_replicate=1, router_replay="off",
                               router_replay_live_mismatch=False, moe_aux_loss_coef=0.0, lora=LoRAConfig())


def reference_engine_config(cfg: TandemConfig) -> TrainEngineConfig:
    """The reference's engine: the actor's layout and options, its own path, live MoE routing, no
    LoRA adapters (under LoRA the reference is the base, which a fresh adapter leaves unchanged)."""
    return dataclasses.replace(cfg.actor, path=cfg.ref.path or cfg.actor.path, router_replay="off",
                               router_replay_live_mismatch=False, moe_aux_loss_coef=0.0, lora=LoRAConfig())


def start_models(cfg: TandemConfig, scheduler: ProcessScheduler) -> TrainerModels:
    """The actor's ranks with its engine, and the critic and reference the algorithm needs."""
    actor = start_workers(cfg, scheduler)
    models = TrainerModels(actor, hidden_size=model_hidden_size(cfg.actor.path))
    if cfg.algo.ppo.kl_ctl > 0:
        models.reference = _initialize(actor.colocated("reference"), reference_engine_config(cfg))
    if cfg.algo.ppo.use_critic:
        if cfg.critic.backend:
            comp = parse_allocation_of_kind(cfg.critic.backend, "critic.backend", inference=False).components[0]
            critic = start_workers(cfg, scheduler, comp, role="critic")
        else:
            critic = actor.colocated("critic")
        models.critic = _initialize(critic, critic_engine_config(cfg))
    return models


def _initialize(controller: TrainController, config: TrainEngineConfig) -> TrainController:
    began = time.monotonic()
    ranks = controller.initialize(config)
    logger.info("%s: engine ready on %d rank(s) from %s after %.1f s", controller.role, len(ranks), config.path,
                time.monotonic() - began)
    return controller

"""`tandem sft sft.objective=reward`: a reward model trained on preference pairs (Bradley-Terry).

The model is the actor's decoder with a scalar value head (a critic's engine on the actor's
ranks, the head starting at zero); each step draws `sft.batch_size` pairs (from `sft.preferences`,
else from the task's items: `tandem.data.preferences`), split whole across the data-parallel ranks,
and takes one optimizer step (`tandem.train.preference_step`). Held-out pairs are scored before and
after. The result is an HF `...ForTokenClassification` directory with one label, which
`tandem serve --is-embedding` serves and `reward_model.path` takes (docs/rewards.md)."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any

from tandem.config.alloc import parse_allocation_of_kind
from tandem.config.lora import LoRAConfig
from tandem.data.preferences import (
    PreferencePair,
    preference_batch,
    preference_file_pairs,
    score_token_of,
    task_pairs,
)
from tandem.data.tasks.base import Task, TaskDataError
from tandem.launch.factory import make_scheduler
from tandem.rl.cluster import run_processes, start_workers
from tandem.rl.config import SFTRunConfig
from tandem.rl.data import load_task_data
from tandem.rl.sft import sft_metrics, sft_outputs
from tandem.train.controller import TrainController

logger = logging.getLogger(__name__)


def run_reward_sft(cfg: SFTRunConfig) -> tuple[Path, dict[str, float]]:
    """Train, save; returns the HF directory and the held-out pairs' `eval/reward_*` stats after
    training (empty without held-out pairs)."""
    from tqdm import tqdm
    from transformers import AutoTokenizer

    run_dir, out = sft_outputs(cfg)
    tokenizer = AutoTokenizer.from_pretrained(cfg.actor.path)
    train, held_out = preference_pairs(cfg, tokenizer)
    logger.info("reward model: %d training pairs, %d held out", len(train), len(held_out))
    score_token = score_token_of(tokenizer)
    metrics = sft_metrics(cfg, run_dir)
    result: dict[str, float] = {}
    try:
        with make_scheduler(cfg.scheduler, run_dir, host=cfg.cluster.host_ip,
                            processes=run_processes(cfg)) as scheduler:
            comp = parse_allocation_of_kind(cfg.actor.backend, "actor.backend", inference=False).components[0]
            trainer = start_workers(cfg, scheduler, comp, role="critic")
            trainer.initialize(dataclasses.replace(cfg.actor, lora=LoRAConfig()))
            if held_out:
                metrics.log(0, _evaluate(trainer, held_out, score_token), phase="sft")
            size = cfg.sft.batch_size
            for step in tqdm(range(cfg.sft.steps), desc="reward model", unit="step", disable=not cfg.stats.progress):
                chunk = [train[(step * size + i) % len(train)] for i in range(size)]
                metrics.log(step + 1, trainer.preference_update(_shards(chunk, trainer.dp_size, score_token)),
                            phase="sft")
            if held_out:
                result = _evaluate(trainer, held_out, score_token)
                metrics.log(cfg.sft.steps, result, phase="sft")
            trainer.save_hf(str(out), tokenizer_dir=cfg.actor.path, overwrite=True)
            trainer.shutdown()
    finally:
        metrics.close()
    return out, result


def preference_pairs(cfg: SFTRunConfig, tokenizer: Any) -> tuple[list[PreferencePair], list[PreferencePair]]:
    """(training pairs, held-out pairs): from `sft.preferences` (its last `task.eval_size` rows held
    out), else from the task's train and eval items."""
    system_prompt = cfg.task.system_prompt
    if cfg.sft.preferences:
        pairs = preference_file_pairs(cfg.sft.preferences, tokenizer, system_prompt)
        n_eval = min(cfg.task.eval_size, len(pairs) - 1)
        train, held_out = pairs[: len(pairs) - n_eval], pairs[len(pairs) - n_eval:]
    else:
        data = load_task_data(cfg, tokenizer)
        if type(data.task).sft_messages is not Task.sft_messages:
            raise TaskDataError(f"task {cfg.task.name!r} is multi-turn (its reference is a conversation with tool "
                                "calls): preference pairs from the task need a single-turn one; give a file of pairs "
                                "in sft.preferences")
        train = task_pairs(data.train, data.task, tokenizer, system_prompt, seed=cfg.experiment.seed)
        held_out = task_pairs(data.eval, data.task, tokenizer, system_prompt, seed=cfg.experiment.seed) \
            if len(data.eval) >= 2 else []
    if not train:
        raise TaskDataError("no preference pair to train on: the task's reward never preferred a reference answer "
                            "to another item's (set task.options.teacher_slip=0), or the file has no rows")
    return train, held_out


def _shards(pairs: list[PreferencePair], dp: int, score_token: int) -> list:
    """Whole pairs per data-parallel rank, dealt round robin."""
    return [preference_batch(pairs[r::dp], score_token) for r in range(dp)]


def _evaluate(trainer: TrainController, pairs: list[PreferencePair], score_token: int) -> dict[str, float]:
    stats = trainer.preference_scores(_shards(pairs, trainer.dp_size, score_token))
    return {f"eval/{key.replace('/', '_')}": value for key, value in stats.items()}

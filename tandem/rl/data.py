"""Task items for a run: the train stream (with a cursor, for resuming) and the eval set."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from tandem.data.tasks import Task, get_task
from tandem.data.tasks.chat import with_input_ids
from tandem.rl.config import TandemConfig
from tandem.rollout.frontier import STREAM_INDEX

logger = logging.getLogger(__name__)


class CursorLoader:
    """An endless, ordered stream over `items` (epoch after epoch) that counts what it handed out.

    Each drawn item is a copy tagged with its position in the stream (`item[STREAM_INDEX]`), which
    the rollout executor tracks to know which items are done with (`tandem.rollout.frontier`).
    A resumed run starts at its checkpoint's frontier (`cursor`) and skips the positions beyond it
    that were already done with (`skip`), so nothing is trained twice or left out.
    """

    def __init__(self, items: list[dict[str, Any]], cursor: int = 0, skip: Iterable[int] = ()):
        if not items:
            raise ValueError("no training items")
        self.items, self.cursor = items, cursor
        self.skip = {i for i in skip if i >= cursor}

    def __iter__(self) -> CursorLoader:
        return self

    def __next__(self) -> dict[str, Any]:
        while self.cursor in self.skip:
            self.skip.discard(self.cursor)
            self.cursor += 1
        item = {**self.items[self.cursor % len(self.items)], STREAM_INDEX: self.cursor}
        self.cursor += 1
        return item


@dataclass
class TaskData:
    task: Task
    train: list[dict[str, Any]]
    eval: list[dict[str, Any]]


def load_task_data(cfg: TandemConfig, tokenizer: Any) -> TaskData:
    """The configured task's train and eval items, prompts rendered to token ids once."""
    task = get_task(cfg.task.name, **dict(cfg.task.options))
    seed = cfg.experiment.seed
    system = cfg.task.system_prompt
    train = with_input_ids(task.generate(cfg.task.train_size, seed=seed, split="train"), tokenizer, system)
    evals = unique_prompts(with_input_ids(task.generate(cfg.task.eval_size, seed=seed, split="eval"), tokenizer, system))
    if len(evals) < cfg.task.eval_size:
        # A small task's eval split holds fewer problems than asked for; a repeated problem would
        # count twice in the accuracy, so the eval set is the distinct problems only.
        logger.warning("task %s has %d distinct eval problems (task.eval_size=%d); evaluating on those",
                       cfg.task.name, len(evals), cfg.task.eval_size)
    return TaskData(task, train, evals)


def unique_prompts(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The items with distinct prompts (token ids), first occurrence kept, order preserved."""
    seen: set[tuple[int, ...]] = set()
    out = []
    for item in items:
        key = tuple(item["input_ids"])
        if key not in seen:
            seen.add(key)
            out.append(item)
    return out

"""Preference pairs for reward-model training (`tandem sft sft.objective=reward`).

A pair is one prompt with a chosen and a rejected answer, each encoded as the whole conversation
the reward model will score: the chat template's prompt, the answer, EOS (exactly the ids a served
reward model gets from a rollout: prompt ids + completion ids). Pairs come from a file
(`preference_file_pairs`: JSON lines or parquet rows, TRL's preference formats) or from a task's
own items (`task_pairs`: the reference answer against another item's, kept only where the task's
reward prefers it). `preference_batch` lays pairs out for the trainer (docs/rewards.md, "Training a
reward model")."""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tandem.data.batch import SequenceBatch
from tandem.data.tasks.base import Task, TaskDataError, item_messages
from tandem.data.tasks.chat import encode_conversation, sft_example
from tandem.data.tasks.files import read_table

FILE_FORMAT = ("rows with `chosen` and `rejected`: answer strings with a `prompt` string, or message lists "
               "(the assistant's turns after a `prompt` message list, or whole conversations without one)")


@dataclass(frozen=True)
class PreferencePair:
    """Token ids of one prompt with its chosen and its rejected answer (each: prompt, answer, EOS)."""

    chosen: list[int]
    rejected: list[int]


def preference_file_pairs(path: str | Path, tokenizer: Any, system_prompt: str | None = None) -> list[PreferencePair]:
    """Every row of a local .jsonl/.parquet file of preferences, encoded; `TaskDataError` naming the
    file, the row and the key for a row that is not one of TRL's formats:

    - `prompt` (string), `chosen` and `rejected` (the assistant's answer strings);
    - `prompt` (messages), `chosen` and `rejected` (messages: the assistant's turns that follow);
    - `chosen` and `rejected` only (messages: whole conversations, sharing their prompt)."""
    rows = read_table(path, "preference file", FILE_FORMAT)
    pairs = []
    for i, row in enumerate(rows):
        where = f"preference file {str(path)!r}, row {i}"
        chosen, rejected = (_conversation(row, key, where, system_prompt) for key in ("chosen", "rejected"))
        pairs.append(PreferencePair(_encode(chosen, tokenizer, where, "chosen"),
                                    _encode(rejected, tokenizer, where, "rejected")))
    return pairs


def _conversation(row: dict[str, Any], key: str, where: str, system_prompt: str | None) -> list[dict[str, Any]]:
    answer, prompt = row.get(key), row.get("prompt")
    if answer is None:
        raise TaskDataError(f"{where}: no {key!r}; a preference row holds {FILE_FORMAT}")
    if isinstance(prompt, str) and isinstance(answer, str):
        messages = [{"role": "user", "content": prompt}, {"role": "assistant", "content": answer}]
    elif isinstance(answer, list) and (prompt is None or isinstance(prompt, list)):
        messages = [*(prompt or []), *answer]
    else:
        raise TaskDataError(f"{where}: {key!r} is a {type(answer).__name__} with a {type(prompt).__name__} `prompt`; "
                            f"a preference row holds {FILE_FORMAT}")
    if not all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages):
        raise TaskDataError(f"{where}: {key!r} holds a message without a `role`; messages are "
                            "{'role': ..., 'content': ...} objects")
    if messages[-1]["role"] != "assistant":
        raise TaskDataError(f"{where}: {key!r} does not end with an assistant message; the reward model scores "
                            "the assistant's answer")
    return item_messages({"messages": messages}, system_prompt)


def _encode(messages: list[dict[str, Any]], tokenizer: Any, where: str, key: str) -> list[int]:
    try:
        return encode_conversation(messages, tokenizer)["input_ids"]
    except ValueError as exc:  # the template's own refusal (TemplateError is a ValueError)
        raise TaskDataError(f"{where}: {key!r}: {exc}") from exc


def task_pairs(items: list[dict[str, Any]], task: Task, tokenizer: Any, system_prompt: str | None = None,
               seed: int = 0) -> list[PreferencePair]:
    """Pairs made from a single-turn task's items: chosen = the item's reference answer, rejected =
    the reference of another item drawn at random; a pair is kept only when the task's reward
    scores the chosen answer above the rejected one (so a slipped reference, `teacher_slip`, or a
    coincidentally equal answer makes no pair). Needs at least two items."""
    if len(items) < 2:
        raise TaskDataError(f"preference pairs from the task need at least two items, got {len(items)}")
    rng = random.Random(f"pairs:{seed}")
    answers = [task.sft_target(item) for item in items]
    pairs = []
    for i, item in enumerate(items):
        j = rng.randrange(len(items) - 1)
        other = answers[j + (j >= i)]  # any item but this one
        if task.reward(answers[i], item) <= task.reward(other, item):
            continue
        pairs.append(PreferencePair(sft_example(item, tokenizer, answers[i], system_prompt)["input_ids"],
                                    sft_example(item, tokenizer, other, system_prompt)["input_ids"]))
    return pairs


def preference_batch(pairs: list[PreferencePair], score_token: int) -> SequenceBatch:
    """Sequences 2k (chosen) and 2k+1 (rejected) of pair k, each followed by `score_token` and a
    loss mask of 1 there only: in prediction alignment the one loss position is the pair member's
    last real token, the position a served reward model scores. The token itself is seen by no
    other position (causal attention), so any id will do."""
    ids, masks = [], []
    for pair in pairs:
        for seq in (pair.chosen, pair.rejected):
            ids.append([*seq, score_token])
            masks.append([0] * len(seq) + [1])
    return SequenceBatch.from_token_lists(ids, loss_mask=masks)


def score_token_of(tokenizer: Any) -> int:
    """The token `preference_batch` appends: the pad token, else EOS."""
    token = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if token is None:
        raise ValueError("the tokenizer has neither a pad nor an EOS token")
    return int(token)


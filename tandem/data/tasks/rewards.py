"""Reward functions for the rollout reward runner (`tandem.rollout.reward`).

Every function here has the runner's signature,

    fn(prompt_text, completion_text, prompt_ids, completion_ids, **item_fields) -> float

and is picklable, so it runs in the reward worker pool. Item fields other than `id`, `prompt`,
`messages` and `input_ids` arrive as keywords (`answer`, `task`, `numbers`, `target`, ...).

- `arithmetic_reward`, `calculator_reward`, `countdown_reward`, `gsm8k_reward`: a task's exact reward with its default
  options (reference one in a config as `tandem.data.tasks.rewards:arithmetic_reward`);
- `task_reward`: dispatches on the item's `task` field to the same defaults;
- `TaskReward(task)` (also `task.reward_fn()`): the reward of a configured task object, for options
  that change scoring (`format_weight`, countdown's `must_use_all`).
"""

from __future__ import annotations

from typing import Any

from tandem.data.tasks.base import Task, get_task

_DEFAULTS: dict[str, Task] = {}  # per process: default-option tasks, built on first use


def _default(name: str) -> Task:
    if name not in _DEFAULTS:
        _DEFAULTS[name] = get_task(name)
    return _DEFAULTS[name]


class TaskReward:
    """A configured task's reward as a picklable callable with the runner's signature."""

    def __init__(self, task: Task):
        self.task = task
        self.__name__ = f"{task.name}_reward"

    def __call__(self, prompt_text: str, completion_text: str, prompt_ids: list[int], completion_ids: list[int],
                 **fields: Any) -> float:
        return self.task.reward(completion_text, fields)

    def __repr__(self) -> str:
        return f"TaskReward({self.task.name})"


def task_reward(prompt_text: str, completion_text: str, prompt_ids: list[int], completion_ids: list[int],
                **fields: Any) -> float:
    """The reward of the item's own task (its `task` field), with that task's default options."""
    return _default(fields["task"]).reward(completion_text, fields)


def arithmetic_reward(prompt_text: str, completion_text: str, prompt_ids: list[int], completion_ids: list[int],
                      **fields: Any) -> float:
    return _default("arithmetic").reward(completion_text, fields)


def calculator_reward(prompt_text: str, completion_text: str, prompt_ids: list[int], completion_ids: list[int],
                      **fields: Any) -> float:
    """The calculator task's reward of the final answer text (the agent's last assistant message)."""
    return _default("calculator").reward(completion_text, fields)


def countdown_reward(prompt_text: str, completion_text: str, prompt_ids: list[int], completion_ids: list[int],
                     **fields: Any) -> float:
    return _default("countdown").reward(completion_text, fields)


def gsm8k_reward(prompt_text: str, completion_text: str, prompt_ids: list[int], completion_ids: list[int],
                 **fields: Any) -> float:
    return _default("gsm8k").reward(completion_text, fields)

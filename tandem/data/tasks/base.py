"""The `Task` interface, train/eval splitting and the task registry.

A task makes items (`generate(n, seed, split)`: deterministic, plain values only, each with at least
`id`, `prompt`, `messages`, `answer`, `task`, `split`) and scores completions (`reward(text, item)`,
never raising on model text); `sft_target` / `sft_messages` give the reference completion and
conversation, `reward_fn()` a picklable rollout reward bound to the task. Splits are disjoint by
content (a hash of the problem's canonical key against `eval_fraction`), whatever the seed. See
docs/tasks.md, "The Task interface"."""

from __future__ import annotations

import hashlib
import importlib
import inspect
import random
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, ClassVar

from tandem.errors import ConfigError

SPLITS = ("train", "eval")
_SPLIT_ALIASES = {"train": "train", "eval": "eval", "test": "eval", "validation": "eval"}


class TaskError(ConfigError):
    """A task name, option or split is wrong, or a task cannot produce what was asked."""


class TaskDataError(TaskError):
    """A task's data file is missing, unreadable or not in the expected format."""


def normalize_split(split: str) -> str:
    """'train' or 'eval' ('test' and 'validation' are accepted for 'eval')."""
    try:
        return _SPLIT_ALIASES[split]
    except (KeyError, TypeError):
        raise TaskError(f"unknown split {split!r}: use 'train' or 'eval'") from None


def split_of(key: str, eval_fraction: float) -> str:
    """The split a problem belongs to, from a hash of its canonical key (stable across runs and seeds)."""
    digest = hashlib.sha256(key.encode("utf-8")).digest()
    bucket = int.from_bytes(digest[:8], "big") / 2**64  # uniform in [0, 1)
    return "eval" if bucket < eval_fraction else "train"


def check_fraction(eval_fraction: float) -> float:
    if not 0.0 < eval_fraction < 1.0:
        raise TaskError(f"eval_fraction must be strictly between 0 and 1, got {eval_fraction!r}")
    return float(eval_fraction)


def cycled_order(count: int, n: int, rng: random.Random) -> list[int]:
    """`n` indices into `count` rows: a shuffled pass over all of them, then another, and so on."""
    order: list[int] = []
    while len(order) < n:
        perm = list(range(count))
        rng.shuffle(perm)
        order += perm
    return order[:n]


def chat_messages(prompt: str, system_prompt: str | None = None) -> list[dict[str, str]]:
    messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
    return [*messages, {"role": "user", "content": prompt}]


def item_messages(item: dict[str, Any], system_prompt: str | None = None) -> list[dict[str, Any]]:
    """The item's chat messages (`messages`, else `prompt` as one user turn), with an optional
    system prompt put first unless the item already starts with a system message."""
    messages = list(item.get("messages") or [{"role": "user", "content": item["prompt"]}])
    if system_prompt and (not messages or messages[0]["role"] != "system"):
        messages.insert(0, {"role": "system", "content": system_prompt})
    return messages


class Task(ABC):
    """Base class of the built-in tasks; subclass it (and `register_task`) to add one."""

    name: ClassVar[str] = ""

    def __init__(self, system_prompt: str | None = None, format_weight: float = 0.0):
        if not 0.0 <= format_weight < 1.0:
            raise TaskError(f"{self.name}: format_weight must be in [0, 1), got {format_weight!r}")
        self.system_prompt = system_prompt
        self.format_weight = float(format_weight)

    @abstractmethod
    def generate(self, n: int, seed: int = 0, split: str = "train") -> list[dict[str, Any]]:
        """`n` items of `split`, deterministic in (`n`, `seed`, `split`) and the task's options."""

    @abstractmethod
    def reward(self, completion_text: str, item: dict[str, Any]) -> float:
        """1.0 for a correct completion; `format_weight` for a wrong one in the right format; else 0.0."""

    @abstractmethod
    def sft_target(self, item: dict[str, Any]) -> str:
        """A reference completion (without the end-of-turn token) that gets reward 1.0."""

    def sft_messages(self, item: dict[str, Any]) -> list[dict[str, Any]]:
        """The reference conversation SFT trains on (loss on its assistant turns), rendered with the
        item's `tools`: by default the item's messages and one assistant turn, `sft_target(item)`.
        A multi-turn task (tool calls, tool results) gives the whole conversation instead."""
        return [*item_messages(item), {"role": "assistant", "content": self.sft_target(item)}]

    def reward_fn(self) -> Callable[..., float]:
        """This task's reward with the rollout signature; picklable (for the reward worker pool)."""
        from tandem.data.tasks.rewards import TaskReward  # rewards.py builds on this module

        return TaskReward(self)

    def make_item(self, index: int, seed: int, split: str, prompt: str, answer: str, **fields: Any) -> dict[str, Any]:
        return {
            "id": f"{self.name}-{split}-{seed}-{index:05d}",
            "prompt": prompt,
            "messages": chat_messages(prompt, self.system_prompt),
            "answer": answer,
            "task": self.name,
            "split": split,
            **fields,
        }

    def _draw(self, n: int, seed: int, split: str, eval_fraction: float, sample: Callable[[random.Random], Any],
              key: Callable[[Any], str]) -> list[Any]:
        """`n` problems from `sample(rng)` that fall in `split`, unique until the split runs out of new ones."""
        if n < 0:
            raise TaskError(f"{self.name}: n must be >= 0, got {n}")
        split = normalize_split(split)
        rng = random.Random(f"{self.name}:{seed}:{split}")
        seen: set[str] = set()
        out: list[Any] = []
        stale = 0  # consecutive draws that were in the split but already seen
        misses = 0  # consecutive draws outside the split
        allow_repeats = False
        while len(out) < n:
            problem = sample(rng)
            k = key(problem)
            if split_of(f"{self.name}:{k}", eval_fraction) != split:
                misses += 1
                if misses > 100_000:
                    raise TaskError(f"{self.name}: no problem of these options falls in the {split!r} split; "
                                    "widen the options or change eval_fraction")
                continue
            misses = 0
            if k in seen and not allow_repeats:
                stale += 1
                allow_repeats = stale > 500  # the split's problems are (nearly) used up: repeat them
                continue
            stale = 0
            seen.add(k)
            out.append(problem)
        return out


# name -> factory; built-ins as "module:attribute" strings, resolved on first use (no import cycles).
_REGISTRY: dict[str, Callable[..., Task] | str] = {
    "arithmetic": "tandem.data.tasks.arithmetic:ArithmeticTask",
    "calculator": "tandem.data.tasks.calculator:CalculatorTask",
    "code": "tandem.data.tasks.code:CodeTask",
    "countdown": "tandem.data.tasks.countdown:CountdownTask",
    "gsm8k": "tandem.data.tasks.gsm8k:GSM8KTask",
}


def register_task(name: str, factory: Callable[..., Task]) -> None:
    """Make `get_task(name, **options)` call `factory(**options)`."""
    if name in _REGISTRY:
        raise TaskError(f"task {name!r} is already registered")
    _REGISTRY[name] = factory


def available_tasks() -> list[str]:
    return sorted(_REGISTRY)


def _resolve(name: str) -> Callable[..., Task]:
    entry = _REGISTRY[name]
    if isinstance(entry, str):
        module, attr = entry.split(":")
        entry = _REGISTRY[name] = getattr(importlib.import_module(module), attr)
    return entry


def get_task(name: str, **options: Any) -> Task:
    """A task by registered name, built with `options` (e.g. `get_task("arithmetic", difficulty="add2")`)."""
    if name not in _REGISTRY:
        raise TaskError(f"unknown task {name!r}; available: {', '.join(available_tasks())}")
    factory = _resolve(name)
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):
        params = {}
    if params and not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        unknown = sorted(set(options) - set(params))
        if unknown:
            valid = ", ".join(p for p in params if p != "self")
            raise TaskError(f"task {name!r} has no option {', '.join(map(repr, unknown))}; options: {valid}")
    return factory(**options)

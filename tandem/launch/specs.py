"""Picklable descriptions of code to run in a worker: dotted paths, never lambdas."""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any


def import_object(path: str) -> Any:
    """`pkg.mod:attr.sub` or `pkg.mod.attr` -> the object."""
    if ":" in path:
        module_name, _, attr = path.partition(":")
        obj: Any = importlib.import_module(module_name)
        for part in attr.split("."):
            obj = getattr(obj, part)
        return obj
    parts = path.split(".")
    for i in range(len(parts) - 1, 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ModuleNotFoundError as exc:
            if exc.name and ".".join(parts[:i]).startswith(exc.name):
                continue
            raise
        for part in parts[i:]:
            obj = getattr(obj, part)
        return obj
    raise ImportError(f"cannot import {path!r}: give 'package.module:name'")


@dataclass(frozen=True)
class LossSpec:
    """A loss function that can be sent to a worker.

    `fn`: dotted path of a loss function `(logprobs, entropy, mb) -> summed loss`, or, with
    `factory=True`, of a function called as `fn(**kwargs)` that returns one (e.g.
    `tandem.algo.losses:make_policy_loss` with `{"cfg": PPOConfig(...), "version": 3}`).
    `weight_fn`: dotted path of the normaliser (default: loss-token count)."""

    fn: str
    kwargs: dict[str, Any] = field(default_factory=dict)
    factory: bool = False
    weight_fn: str | None = None

    def resolve(self) -> tuple[Any, Any]:
        fn = import_object(self.fn)
        if self.factory:
            fn = fn(**self.kwargs)
        elif self.kwargs:
            raise ValueError(f"LossSpec({self.fn!r}) has kwargs but factory=False; a plain loss takes none")
        weight = import_object(self.weight_fn) if self.weight_fn else None
        return fn, weight

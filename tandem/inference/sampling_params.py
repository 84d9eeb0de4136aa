"""Per-request sampling parameters: SGLang's `sampling_params` fields, defaults and valid ranges."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from tandem.inference.errors import RequestError

GREEDY_TEMPERATURE = 1e-6  # below this, sampling is argmax
# Sample i of a request uses seed + i for its torch.Generator, which takes seeds below 2**64: a
# signed 64-bit seed leaves room for any n.
MAX_SEED = 2**63 - 1


@dataclass
class SamplingParams:
    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = -1  # -1 or None: the whole vocabulary
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # SGLang's: over prompt + output tokens
    min_new_tokens: int = 0
    stop_token_ids: list[int] = field(default_factory=list)
    stop: str | list[str] = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True  # text only: passed to the tokenizer's decode
    no_stop_trim: bool = False  # text only: keep the matched stop token / string in `text`
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    n: int = 1
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.stop is None:
            self.stop = []
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.validate()

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> SamplingParams:
        """Build from a JSON object; unknown keys are an error (they are usually typos)."""
        data = dict(data or {})
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise RequestError(f"unknown sampling_params field(s) {unknown}; valid fields: {sorted(known)}")
        return cls(**data)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def vocab_top_k(self) -> int:
        """top_k as a count, 0 meaning the whole vocabulary."""
        return 0 if self.top_k is None or self.top_k == -1 else self.top_k

    def validate(self) -> None:
        _check_int("max_new_tokens", self.max_new_tokens, low=1)
        _check_int("min_new_tokens", self.min_new_tokens, low=0)
        if self.min_new_tokens > self.max_new_tokens:
            raise RequestError(
                f"sampling_params.min_new_tokens={self.min_new_tokens} must be <= max_new_tokens "
                f"({self.max_new_tokens})"
            )
        _check_float("temperature", self.temperature, "must be a finite number >= 0",
                     lambda x: math.isfinite(x) and x >= 0)
        _check_float("top_p", self.top_p, "must be in (0, 1]", lambda x: 0 < x <= 1)
        _check_float("min_p", self.min_p, "must be in [0, 1]", lambda x: 0 <= x <= 1)
        _check_float("repetition_penalty", self.repetition_penalty, "must be in (0, 2] (1 = none)",
                     lambda x: 0 < x <= 2)
        if self.top_k is not None and self.top_k != -1:
            _check_int("top_k", self.top_k, low=1, extra="(or -1 / null for the whole vocabulary)")
        for name in ("frequency_penalty", "presence_penalty"):
            _check_float(name, getattr(self, name), "must be in [-2, 2]", lambda x: -2 <= x <= 2)
        _check_int("n", self.n, low=1)
        if self.seed is not None:
            _check_int("seed", self.seed, low=0, high=MAX_SEED)
        if not isinstance(self.stop_token_ids, list | tuple) or not all(
            _is_int(t) and t >= 0 for t in self.stop_token_ids
        ):
            raise RequestError(
                f"sampling_params.stop_token_ids must be a list of token ids >= 0, got {self.stop_token_ids!r}"
            )
        self.stop_token_ids = list(self.stop_token_ids)
        if not isinstance(self.stop, list) or not all(isinstance(s, str) and s for s in self.stop):
            raise RequestError(
                f"sampling_params.stop must be a non-empty string or a list of them, got {self.stop!r}"
            )
        for name in ("ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim"):
            if not isinstance(getattr(self, name), bool):
                raise RequestError(f"sampling_params.{name} must be true or false, got {getattr(self, name)!r}")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_int(name: str, value: Any, low: int, extra: str = "", high: int | None = None) -> None:
    if not _is_int(value) or value < low or (high is not None and value > high):
        valid = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise RequestError(f"sampling_params.{name} must be an integer {valid}{' ' + extra if extra else ''}, "
                           f"got {value!r}")


def _check_float(name: str, value: Any, rule: str, ok: Any) -> None:
    if not isinstance(value, int | float) or isinstance(value, bool) or value != value or not ok(value):
        raise RequestError(f"sampling_params.{name} {rule}, got {value!r}")

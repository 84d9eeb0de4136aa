"""Request and response types of the inference client (backend-neutral)."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

from tandem.data.trajectory import Trajectory
from tandem.fleet.generation import FinishReason, GenerationParams


@dataclass
class ModelRequest:
    input_ids: list[int]
    params: GenerationParams = field(default_factory=GenerationParams)
    # Context limit for prompt + generated tokens; None = only `params.max_new_tokens` bounds it.
    max_tokens: int | None = None
    rid: str = field(default_factory=lambda: uuid.uuid4().hex)
    # Seconds for the whole request (all chunks, retries, waits); None = the client's default.
    deadline_s: float | None = None


@dataclass
class ScoreRequest:
    """Score a sequence's own tokens with the servers' weights, generating nothing: the logprobs
    of `input_ids[start:]` (`start` >= 1), at temperature 1 (e.g. a teacher's, for distillation)."""

    input_ids: list[int]
    start: int
    rid: str = field(default_factory=lambda: uuid.uuid4().hex)
    # Seconds for the whole request (all calls, retries, waits); None = the client's default.
    deadline_s: float | None = None


@dataclass
class ClassifyRequest:
    """Score whole sequences with the servers' classifier (a reward model): one number each."""

    sequences: list[list[int]]
    rid: str = field(default_factory=lambda: uuid.uuid4().hex)
    deadline_s: float | None = None  # as ModelRequest's


@dataclass
class ModelResponse:
    rid: str
    input_ids: list[int]
    output_ids: list[int]
    output_logprobs: list[float]
    output_versions: list[int]
    finish_reason: FinishReason
    servers: list[str] = field(default_factory=list)  # server of each /generate call that returned
    num_calls: int = 0
    num_aborts: int = 0
    num_retries: int = 0
    latency_s: float = 0.0
    # With ClientConfig.routed_expert_layout: `[len(input_ids) + len(output_ids)][moe layers][top_k]` expert
    # ids in input alignment (`Trajectory.routed_experts`; the last token's row is -1s).
    routed_experts: list[list[list[int]]] | None = None

    def to_trajectory(self, **fields: Any) -> Trajectory:
        fields.setdefault("finish_reasons", [self.finish_reason])
        fields.setdefault("routed_experts", self.routed_experts)
        fields.setdefault("timing", {"generate": self.latency_s})
        return Trajectory.from_generation(
            self.input_ids, self.output_ids, self.output_logprobs, self.output_versions, **fields
        )

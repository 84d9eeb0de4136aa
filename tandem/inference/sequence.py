"""One generated sequence: its tokens, KV blocks, sampling state and how it finished."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from enum import Enum, auto
from typing import Any

import torch

from tandem.inference.sampling_params import SamplingParams

_seq_ids = itertools.count()


class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


@dataclass(eq=False)
class Sequence:
    """`token_ids` is prompt + output. A request with n > 1 starts as ONE sequence (`fork_n == n`)
    whose prompt is prefilled once; the engine then forks it into n samples sharing the prompt's
    KV blocks. `num_computed_tokens` is how many leading tokens already have KV in the cache."""

    rid: str
    token_ids: list[int]
    params: SamplingParams
    generator: torch.Generator
    return_logprob: bool = False
    return_routed_experts: bool = False  # the output carries the experts of every forwarded token
    top_logprobs_num: int = 0  # with return_logprob: the k most likely tokens of each output step
    index: int = 0  # which of the request's n samples
    sibling_seeds: list[int] = field(default_factory=list)  # seeds of samples 1..n-1, until forked
    arrival_time: float = 0.0
    seq_id: int = field(default_factory=lambda: next(_seq_ids))
    num_prompt_tokens: int = 0
    status: SequenceStatus = SequenceStatus.WAITING
    block_table: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens served from the prefix cache (reported in meta_info)
    output_logprobs: list[float] = field(default_factory=list)
    output_top_logprobs: list[list[tuple[float, int]]] = field(default_factory=list)  # per output token
    # With logprob_start_len: the prompt's logprobs from it (LLMEngine.prompt_logprobs), else None.
    input_logprobs: list[float | None] | None = None
    input_top_logprobs: list[list[tuple[float, int]] | None] | None = None
    finish_reason: dict[str, Any] | None = None
    text: str | None = None  # decoded output, set when a tokenizer is present and the sequence ends
    was_started: bool = False  # produced at least one forward pass (aborts then report partial output)

    def __post_init__(self) -> None:
        self.num_prompt_tokens = self.num_prompt_tokens or len(self.token_ids)

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def fork_n(self) -> int:
        return 1 + len(self.sibling_seeds)

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def num_blocks(self, block_size: int) -> int:
        return (len(self.token_ids) + block_size - 1) // block_size

    def block_tokens(self, i: int, block_size: int) -> list[int]:
        return self.token_ids[i * block_size : (i + 1) * block_size]

    def append(self, token_id: int, logprob: float) -> None:
        self.token_ids.append(token_id)
        self.output_logprobs.append(logprob)

    def fork(self, index: int, generator: torch.Generator) -> Sequence:
        """A sibling sample with the same tokens so far; the block manager shares the blocks."""
        child = Sequence(
            rid=self.rid,
            token_ids=list(self.token_ids),
            params=self.params,
            generator=generator,
            return_logprob=self.return_logprob,
            return_routed_experts=self.return_routed_experts,
            top_logprobs_num=self.top_logprobs_num,
            index=index,
            arrival_time=self.arrival_time,
            num_prompt_tokens=self.num_prompt_tokens,
            status=self.status,
            num_computed_tokens=self.num_computed_tokens,
            cached_tokens=self.cached_tokens,
            was_started=self.was_started,
        )
        child.output_logprobs = list(self.output_logprobs)
        child.output_top_logprobs = list(self.output_top_logprobs)
        child.input_logprobs, child.input_top_logprobs = self.input_logprobs, self.input_top_logprobs
        return child

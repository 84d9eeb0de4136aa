"""What the engine hands back: finished requests, streamed token deltas, and detokenisation.

Text follows SGLang: `output_ids` and logprobs always hold every sampled token (including the stop
token or the token that completed a stop string), while `text` drops a matched stop token and is cut
just before the first occurrence of a matched stop string.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from tandem.inference.sequence import Sequence

# SGLang's finish message for a request aborted before its prefill ran (clients match its prefix).
ABORT_BEFORE_PREFILL = "Abort before prefill"


@dataclass
class RequestOutput:
    rid: str
    index: int  # which of the request's n samples
    output_ids: list[int]
    output_logprobs: list[float] | None  # None without return_logprob ([] when aborted while queued)
    finish_reason: dict[str, Any]
    prompt_tokens: int
    cached_tokens: int
    weight_version: int  # the engine's weight version when the output was made
    e2e_latency: float
    text: str | None = None  # None when the engine has no tokenizer
    # With return_routed_experts: `[prompt + output tokens - 1, n_layers, top_k]` int32 (CPU) expert
    # ids of every token but the last (never forwarded); -1 in dense layers and for tokens whose KV
    # this server never computed (a request aborted while queued).
    routed_experts: torch.Tensor | None = None
    # With return_logprob and top_logprobs_num k > 0: per output token, the k most likely
    # `(logprob, token id)` pairs of the distribution its logprob comes from (sampler.top_logprobs).
    output_top_logprobs: list[list[tuple[float, int]]] | None = None
    # With logprob_start_len s >= 0: the logprobs of prompt tokens s.. (None at position 0), and
    # with top_logprobs_num their top pairs (LLMEngine.prompt_logprobs).
    input_logprobs: list[float | None] | None = None
    input_top_logprobs: list[list[tuple[float, int]] | None] | None = None

    @property
    def completion_tokens(self) -> int:
        return len(self.output_ids)


@dataclass
class TokenDelta:
    """Tokens a streaming request produced in one step."""

    rid: str
    index: int
    token_ids: list[int]
    logprobs: list[float]
    # With top_logprobs_num k > 0: per token, its step's k most likely `(logprob, token id)` pairs.
    top_logprobs: list[list[tuple[float, int]]] | None = None


class Detokenizer:
    """Wraps an HF tokenizer (or nothing): decodes outputs and finds stop strings."""

    def __init__(self, tokenizer: Any | None):
        self.tokenizer = tokenizer

    def decode(self, ids: list[int], skip_special_tokens: bool, spaces_between_special_tokens: bool = True) -> str:
        if spaces_between_special_tokens:
            return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
        # As SGLang passes it: honoured by slow tokenizers, ignored by fast ones.
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens,
                                     spaces_between_special_tokens=False)

    def matched_stop_string(self, seq: Sequence) -> str | None:
        """The first of `stop` (in the request's order) present in the decoded output so far."""
        if not seq.params.stop or self.tokenizer is None:
            return None
        text = self.decode(seq.output_ids, seq.params.skip_special_tokens)
        return next((s for s in seq.params.stop if s in text), None)

    def final_text(self, seq: Sequence) -> str | None:
        if self.tokenizer is None:
            return None
        params = seq.params
        ids, matched = seq.output_ids, (seq.finish_reason or {}).get("matched")
        if params.no_stop_trim:  # SGLang: the stop token or string stays in the text
            matched = None
        if isinstance(matched, int) and ids:
            ids = ids[:-1]
        text = self.decode(ids, params.skip_special_tokens, params.spaces_between_special_tokens)
        if isinstance(matched, str) and (pos := text.find(matched)) != -1:
            text = text[:pos]
        return text


def make_output(seq: Sequence, weight_version: int, text: str | None,
                routed_experts: torch.Tensor | None = None) -> RequestOutput:
    wants_top = seq.return_logprob and seq.top_logprobs_num > 0
    return RequestOutput(
        rid=seq.rid,
        index=seq.index,
        output_ids=list(seq.output_ids),
        output_logprobs=list(seq.output_logprobs) if seq.return_logprob else None,
        output_top_logprobs=list(seq.output_top_logprobs) if wants_top else None,
        input_logprobs=seq.input_logprobs,
        input_top_logprobs=seq.input_top_logprobs if wants_top else None,
        finish_reason=dict(seq.finish_reason or {}),
        prompt_tokens=seq.num_prompt_tokens,
        cached_tokens=seq.cached_tokens,
        weight_version=weight_version,
        e2e_latency=time.monotonic() - seq.arrival_time,
        text=text,
        routed_experts=routed_experts,
    )

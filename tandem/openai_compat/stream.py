"""What chat and completion answers share: one choice's finished output (`ChoiceOutput`), `usage`,
SSE framing, and `StreamBase`, the bookkeeping of a streamed answer.

Streaming sends, per choice, only text that can no longer change: the text decoded so far less a
trailing U+FFFD (a multi-byte character whose bytes have not all arrived), less a trailing piece
that could begin a stop string (or, with tools, `<tool_call>`), cut at a complete one. So the
deltas of a choice add up to the text of the non-streamed answer, and the final text (stop
strings trimmed, tool calls parsed out) only ever appends.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from tandem.openai_compat.tokens import TokenText

SSE_DONE = "data: [DONE]\n\n"


@dataclass
class ChoiceOutput:
    """One finished choice as a server produced it. `logprobs` None: not asked for;
    `top_logprobs`: per token, the k most likely `(logprob, token id)` pairs, most likely first."""

    index: int
    output_ids: list[int]
    text: str
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[float, int]]] | None = None
    finish_reason: str = "stop"  # "stop" | "length" | "abort"
    matched_stop: int | str | None = None
    weight_version: int | str | None = None  # the weights that produced it, when known


def sse(obj: dict[str, Any] | str) -> str:
    """One server-sent event: `data: <json>` and a blank line (a string is sent as it is)."""
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False)}\n\n"


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def envelope(kind: str, id: str, model: str, created: int, weight_version: int | str | None,
             choices: list[dict[str, Any]]) -> dict[str, Any]:
    """The fields around `choices` of every answer and chunk; `weight_version` is an extension."""
    body: dict[str, Any] = {"id": id, "object": kind, "created": created, "model": model, "choices": choices}
    if weight_version is not None:
        body["weight_version"] = weight_version
    return body


def answer(kind: str, id: str, model: str, created: int, weight_version: int | str | None,
           choices: list[ChoiceOutput], prompt_tokens: int,
           fields: Callable[[ChoiceOutput], dict[str, Any]]) -> dict[str, Any]:
    """A whole (not streamed) answer: per choice, in index order, `index`, the kind's own `fields`
    (text or message, logprobs, finish_reason), `matched_stop` and, when known, the choice's
    `weight_version` (extensions); then `usage`."""
    items = []
    for c in sorted(choices, key=lambda c: c.index):
        item = {"index": c.index, **fields(c), "matched_stop": c.matched_stop}
        if c.weight_version is not None:
            item["weight_version"] = c.weight_version
        items.append(item)
    body = envelope(kind, id, model, created, weight_version, items)
    body["usage"] = usage(prompt_tokens, sum(len(c.output_ids) for c in choices))
    return body


@dataclass
class ChoiceProgress:
    """What a stream has sent of one choice."""

    sent: str = ""  # text
    tokens: int = 0  # tokens whose logprobs went out
    started: bool = False  # a chunk went out
    offset: int = 0  # completions: text offset of the next token in logprobs


@dataclass
class NewTokens:
    ids: list[int]
    logprobs: list[float] | None
    top_logprobs: list[list[tuple[float, int]]] | None
    first: int = 0  # position of ids[0] in the choice's output


@dataclass
class StreamBase:
    """Chunks of one streamed request (all its choices). Subclasses shape the chunks."""

    kind: str
    id: str
    model: str
    created: int
    token_text: TokenText
    include_usage: bool
    weight_version: int | str | None
    stop: Sequence[str] = ()
    marker: str | None = None  # text from here on is held back (tool calls)
    strip: bool = False  # the final text is stripped (tool parsing): hold back leading/trailing white space
    choices: dict[int, ChoiceProgress] = field(default_factory=dict)

    def chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return envelope(self.kind, self.id, self.model, self.created, self.weight_version, choices)

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int) -> dict[str, Any] | None:
        """With `include_usage` (stream_options): the last chunk, no choices and the usage."""
        if not self.include_usage:
            return None
        return {**self.chunk([]), "usage": usage(prompt_tokens, completion_tokens)}

    def progress(self, index: int) -> ChoiceProgress:
        return self.choices.setdefault(index, ChoiceProgress())

    def visible(self, text: str) -> str:
        """The part of `text` (a choice's output decoded so far) that may be sent."""
        text = text.rstrip("\ufffd")
        cuts = [*self.stop, *([self.marker] if self.marker else [])]
        hits = [pos for s in cuts if (pos := text.find(s)) != -1]
        if hits:
            text = text[:min(hits)]
        else:
            held = max((k for s in cuts for k in range(1, len(s)) if text.endswith(s[:k])), default=0)
            text = text[:len(text) - held]
        return text.strip() if self.strip else text

    def new_text(self, progress: ChoiceProgress, text: str, final: bool = False) -> str:
        """What of `text` (decoded so far, or with `final` the choice's final text) was not sent yet."""
        text = text if final else self.visible(text)
        if not text.startswith(progress.sent):  # only when decoding rewrote earlier text: nothing to add
            return ""
        new, progress.sent = text[len(progress.sent):], text
        return new

    def new_tokens(self, progress: ChoiceProgress, ids: list[int], logprobs: list[float] | None,
                   top_logprobs: list[list[tuple[float, int]]] | None, cumulative: bool) -> NewTokens:
        """The tokens not reported yet: `ids` are all the choice's (`cumulative`) or the newest."""
        start = progress.tokens if cumulative else 0
        first = progress.tokens
        progress.tokens = first + len(ids) - start
        return NewTokens(ids[start:], None if logprobs is None else logprobs[start:],
                         None if top_logprobs is None else top_logprobs[start:], first)

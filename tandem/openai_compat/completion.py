"""Completions: the `text_completion` answer and its stream.

Logprobs follow the legacy completions shape: `{tokens, token_logprobs, top_logprobs, text_offset}`,
where `top_logprobs[i]` maps the texts of the k most likely tokens at step i to their logprobs and
always holds the sampled token too (so k + 1 entries at most, as OpenAI documents).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tandem.openai_compat.stream import ChoiceOutput, NewTokens, StreamBase, answer
from tandem.openai_compat.tokens import TokenText


def completion_logprobs(tokens: NewTokens, token_text: TokenText, k: int | None,
                        offset: int = 0) -> tuple[dict[str, Any] | None, int]:
    """-> (the logprobs of `tokens`, None when not asked for; the text offset after them).
    `offset` is the text offset of the first token."""
    if tokens.logprobs is None or k is None:
        return None, offset
    texts = [token_text(t) for t in tokens.ids]
    tops = tokens.top_logprobs or [[] for _ in tokens.ids]
    top_maps, offsets = [], []
    for text, lp, top in zip(texts, tokens.logprobs, tops, strict=True):
        alternatives = {token_text(a): alp for alp, a in top[:k]}
        alternatives.setdefault(text, lp)
        top_maps.append(alternatives)
        offsets.append(offset)
        offset += len(text)
    return {"tokens": texts, "token_logprobs": list(tokens.logprobs), "top_logprobs": top_maps,
            "text_offset": offsets}, offset


def text_completion(*, id: str, model: str, created: int, choices: list[ChoiceOutput], prompt_tokens: int,
                    token_text: TokenText, weight_version: int | str | None, logprobs: int | None) -> dict[str, Any]:
    """The `text_completion` answer; `prompt_tokens` counts every prompt. Extensions as in chat:
    `weight_version`, `matched_stop`."""
    def fields(c: ChoiceOutput) -> dict[str, Any]:
        lp, _ = completion_logprobs(NewTokens(c.output_ids, c.logprobs, c.top_logprobs), token_text, logprobs)
        return {"text": c.text, "logprobs": lp, "finish_reason": c.finish_reason}

    return answer("text_completion", id, model, created, weight_version, choices, prompt_tokens, fields)


class CompletionStream(StreamBase):
    """`text_completion` chunks of one request: per choice, text deltas (see `stream.py`) with the
    logprobs of their tokens, and a last chunk with `finish_reason`."""

    def __init__(self, id: str, model: str, created: int, token_text: TokenText, logprobs: int | None,
                 include_usage: bool, weight_version: int | str | None, *, stop: Sequence[str] = ()):
        super().__init__("text_completion", id, model, created, token_text, include_usage, weight_version, tuple(stop))
        self.logprobs = logprobs

    def _chunk(self, index: int, text: str, tokens: NewTokens, finish_reason: str | None = None,
               **extra: Any) -> dict[str, Any] | None:
        p = self.progress(index)
        lp, p.offset = completion_logprobs(tokens, self.token_text, self.logprobs, p.offset)
        if not text and not (lp and lp["tokens"]) and finish_reason is None:
            return None
        return self.chunk([{"index": index, "text": text, "logprobs": lp, "finish_reason": finish_reason, **extra}])

    def delta(self, index: int, token_ids: list[int], logprobs: list[float] | None,
              top_logprobs: list[list[tuple[float, int]]] | None, text_so_far: str) -> list[dict[str, Any]]:
        """As `ChatStream.delta`: the newest tokens of choice `index`, its whole output decoded so far."""
        p = self.progress(index)
        chunk = self._chunk(index, self.new_text(p, text_so_far),
                            self.new_tokens(p, token_ids, logprobs, top_logprobs, False))
        return [chunk] if chunk is not None else []

    def finish(self, choice: ChoiceOutput) -> list[dict[str, Any]]:
        p = self.progress(choice.index)
        text = self.new_text(p, choice.text, final=True)
        tokens = self.new_tokens(p, choice.output_ids, choice.logprobs, choice.top_logprobs, True)
        if choice.weight_version is not None:
            self.weight_version = choice.weight_version
        return [self._chunk(choice.index, text, tokens, choice.finish_reason, matched_stop=choice.matched_stop)]

"""Chat: the prompt through the tokenizer's chat template (with tools), tool calls parsed out of the
answer (Qwen's format), and the `chat.completion` answer and `chat.completion.chunk` stream.

Tool calls use the format of Qwen2.5 / Qwen3 chat templates: the assistant writes each call as
`<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`. With tools, an answer's content is
its text outside the calls, stripped (None when nothing else is left).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from tandem.openai_compat.request import OpenAIRequestError, new_call_id
from tandem.openai_compat.stream import (
    SSE_DONE,
    ChoiceOutput,
    NewTokens,
    StreamBase,
    answer,
    sse,
)
from tandem.openai_compat.tokens import TokenText, token_bytes

__all__ = ["SSE_DONE", "ChatStream", "ChoiceOutput", "chat_completion", "parse_tool_calls", "render_chat", "sse"]

TOOL_CALL_START, TOOL_CALL_END = "<tool_call>", "</tool_call>"


def render_chat(tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                add_generation_prompt: bool = True, template_kwargs: dict[str, Any] | None = None) -> str:
    """The prompt text: `messages` (as `parse_chat_request` normalised them) and `tools` through the
    tokenizer's chat template. Tool call arguments become objects (HF's convention) and a null
    content "" for the template."""
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise OpenAIRequestError("this model's tokenizer has no chat template, so chat messages cannot be turned "
                                 "into a prompt; send a prompt to /v1/completions instead", "messages")
    for_template = []
    for m in messages:
        m = {**m, "content": m.get("content") or ""}
        if "tool_calls" in m:
            m["tool_calls"] = [{**c, "function": {**c["function"], "arguments": json.loads(c["function"]["arguments"])}}
                               for c in m["tool_calls"]]
        for_template.append(m)
    try:
        text = tokenizer.apply_chat_template(for_template, tools=tools, tokenize=False,
                                             add_generation_prompt=add_generation_prompt, **(template_kwargs or {}))
    except Exception as exc:  # jinja errors, raise_exception() in the template, bad kwargs
        raise OpenAIRequestError(f"the model's chat template cannot render these messages"
                                 f"{' and tools' if tools else ''}: {type(exc).__name__}: {exc}", "messages") from exc
    if not isinstance(text, str):
        raise OpenAIRequestError(f"the model's chat template gave {type(text).__name__}, not text", "messages")
    return text


def parse_tool_calls(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """-> (content, tool_calls). Each `<tool_call>{"name", "arguments"}</tool_call>` block becomes an
    OpenAI call `{id, type: "function", function: {name, arguments: JSON string}}`; a block that is
    not a JSON object with a name, and an unclosed trailing `<tool_call>` (cut by the token budget),
    stay in the content. The content is the rest, stripped; None when nothing is left."""
    kept, calls, pos = [], [], 0
    while (start := text.find(TOOL_CALL_START, pos)) != -1:
        end = text.find(TOOL_CALL_END, start + len(TOOL_CALL_START))
        if end == -1:
            break
        call = _tool_call(text[start + len(TOOL_CALL_START):end])
        kept.append(text[pos:start] if call is not None else text[pos:end + len(TOOL_CALL_END)])
        if call is not None:
            calls.append(call)
        pos = end + len(TOOL_CALL_END)
    content = ("".join(kept) + text[pos:]).strip()
    return content or None, calls


def _tool_call(body: str) -> dict[str, Any] | None:
    try:
        call = json.loads(body)
    except ValueError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str) or not call["name"]:
        return None
    args = call.get("arguments", {})
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return {"id": new_call_id(), "type": "function",
            "function": {"name": call["name"], "arguments": json.dumps(args, ensure_ascii=False)}}


def _entry(text: str, logprob: float) -> dict[str, Any]:
    return {"token": text, "logprob": logprob, "bytes": token_bytes(text)}


def chat_logprobs(tokens: NewTokens, token_text: TokenText, top_logprobs: int) -> dict[str, Any] | None:
    """`{"content": [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}, ...]}, ...]}`, or
    None when logprobs were not asked for (`tokens.logprobs` None)."""
    if tokens.logprobs is None:
        return None
    tops = tokens.top_logprobs or [[] for _ in tokens.ids]
    return {"content": [{**_entry(token_text(t), lp),
                         "top_logprobs": [_entry(token_text(a), alp) for alp, a in top[:top_logprobs]]}
                        for t, lp, top in zip(tokens.ids, tokens.logprobs, tops, strict=True)]}


def _finish_reason(choice: ChoiceOutput, calls: list[dict[str, Any]]) -> str:
    """"tool_calls" when the model ended on its own after calling tools; else the engine's reason
    (a call cut short by the token budget stays "length")."""
    return "tool_calls" if calls and choice.finish_reason == "stop" else choice.finish_reason


def _content_and_calls(choice: ChoiceOutput, parse_tools: bool) -> tuple[str | None, list[dict[str, Any]]]:
    return parse_tool_calls(choice.text) if parse_tools else (choice.text, [])


def chat_completion(*, id: str, model: str, created: int, choices: list[ChoiceOutput], prompt_tokens: int,
                    token_text: TokenText, parse_tools: bool, weight_version: int | str | None,
                    top_logprobs: int) -> dict[str, Any]:
    """The `chat.completion` answer. Extensions: `weight_version` (top level, and per choice when
    the choice knows it), `matched_stop` per choice."""
    def fields(c: ChoiceOutput) -> dict[str, Any]:
        content, calls = _content_and_calls(c, parse_tools)
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = calls
        lp = chat_logprobs(NewTokens(c.output_ids, c.logprobs, c.top_logprobs), token_text, top_logprobs)
        return {"message": message, "logprobs": lp, "finish_reason": _finish_reason(c, calls)}

    return answer("chat.completion", id, model, created, weight_version, choices, prompt_tokens, fields)


class ChatStream(StreamBase):
    """`chat.completion.chunk` events of one request (all its choices). Per choice: the first
    chunk carries `role: "assistant"`, then content deltas (never inside a multi-byte character;
    with tools, text from the first `<tool_call>` on is held back), and `finish` sends the rest:
    content, one chunk per tool call (`{index, id, type, function: {name, arguments}}`), and the
    chunk with `finish_reason`. Logprobs (when `delta` / the choice have them) go with the chunk
    of their tokens, even when its text is held back. `stop`: the request's stop strings."""

    def __init__(self, id: str, model: str, created: int, parse_tools: bool, token_text: TokenText,
                 top_logprobs: int, include_usage: bool, weight_version: int | str | None, *,
                 stop: Sequence[str] = ()):
        super().__init__("chat.completion.chunk", id, model, created, token_text, include_usage, weight_version,
                         tuple(stop), TOOL_CALL_START if parse_tools else None, parse_tools)
        self.parse_tools, self.top_logprobs = parse_tools, top_logprobs

    def _chunk(self, index: int, delta: dict[str, Any], logprobs: dict[str, Any] | None = None,
               finish_reason: str | None = None, **extra: Any) -> dict[str, Any]:
        return self.chunk([{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason,
                            **extra}])

    def _delta(self, index: int, text: str) -> dict[str, Any]:
        p = self.progress(index)
        delta: dict[str, Any] = {}
        if not p.started:
            p.started = True
            delta["role"] = "assistant"
            if not self.parse_tools:  # an empty answer is "" (with tools: null)
                delta["content"] = text
        if text:
            delta["content"] = text
        return delta

    def delta(self, index: int, token_ids: list[int], logprobs: list[float] | None,
              top_logprobs: list[list[tuple[float, int]]] | None, text_so_far: str) -> list[dict[str, Any]]:
        """Chunks for the newest tokens of choice `index`; `text_so_far` is its whole output decoded.
        `logprobs` None: not asked for. Call it with no tokens to send the role chunk."""
        p = self.progress(index)
        text = self.new_text(p, text_so_far)
        lp = chat_logprobs(self.new_tokens(p, token_ids, logprobs, top_logprobs, False), self.token_text,
                           self.top_logprobs)
        delta = self._delta(index, text)
        if not delta and not (lp and lp["content"]):
            return []
        return [self._chunk(index, delta, lp)]

    def finish(self, choice: ChoiceOutput) -> list[dict[str, Any]]:
        """The rest of a finished choice: content, tool calls, then the chunk with finish_reason."""
        p = self.progress(choice.index)
        content, calls = _content_and_calls(choice, self.parse_tools)
        text = self.new_text(p, content or "", final=True)
        tokens = self.new_tokens(p, choice.output_ids, choice.logprobs, choice.top_logprobs, True)
        lp = chat_logprobs(tokens, self.token_text, self.top_logprobs)
        chunks = []
        if (delta := self._delta(choice.index, text)) or (lp and lp["content"]):
            chunks.append(self._chunk(choice.index, delta, lp))
        for j, call in enumerate(calls):
            chunks.append(self._chunk(choice.index, {"tool_calls": [{"index": j, **call}]}))
        if choice.weight_version is not None:
            self.weight_version = choice.weight_version
        chunks.append(self._chunk(choice.index, {}, None, _finish_reason(choice, calls),
                                  matched_stop=choice.matched_stop))
        return chunks

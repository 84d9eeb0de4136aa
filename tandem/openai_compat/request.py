"""OpenAI chat and completion request bodies, parsed and checked (pure protocol: no server, no engine).

`parse_chat_request(body)` and `parse_completion_request(body)` return a typed request or raise
`OpenAIRequestError` (a 400 naming the field and the fix). Sampling fields come out under SGLang's
`sampling_params` names, only those the body gave; JSON types are checked here, ranges where they
are used. `HARMLESS_FIELDS` are accepted and returned in `extra`; fields this server cannot honour
are refused unless neutral; unknown fields are a 400 listing the valid ones (the lists:
docs/inference.md, "OpenAI routes")."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from tandem.errors import TandemError

# `max_new_tokens` defaults a server applies itself when a body gives none (parsing leaves it unset).
DEFAULT_CHAT_MAX_TOKENS = 128
DEFAULT_COMPLETION_MAX_TOKENS = 16
MAX_TOP_LOGPROBS = 20
ROLES = ("system", "user", "assistant", "tool")
HARMLESS_FIELDS = frozenset({"parallel_tool_calls", "metadata", "store", "service_tier", "prompt_cache_key",
                             "safety_identifier"})
NO_CONSTRAINED_DECODING = "tandem has no constrained decoding, so it cannot force the model's output"

# OpenAI name (and the vLLM / SGLang extensions) -> (SGLang sampling_params name, JSON kind)
SAMPLING_FIELDS: dict[str, tuple[str, str]] = {
    "max_tokens": ("max_new_tokens", "int"), "temperature": ("temperature", "number"),
    "top_p": ("top_p", "number"), "top_k": ("top_k", "int"), "min_p": ("min_p", "number"), "n": ("n", "int"),
    "stop": ("stop", "stop"), "stop_token_ids": ("stop_token_ids", "ids"), "seed": ("seed", "int"),
    "frequency_penalty": ("frequency_penalty", "number"), "presence_penalty": ("presence_penalty", "number"),
    "repetition_penalty": ("repetition_penalty", "number"), "ignore_eos": ("ignore_eos", "bool"),
    "min_tokens": ("min_new_tokens", "int"), "skip_special_tokens": ("skip_special_tokens", "bool"),
}
_COMMON_FIELDS = frozenset(SAMPLING_FIELDS) | {"model", "stream", "stream_options", "user", "logprobs", "logit_bias"}
_KIND_NAMES = {"str": "a string", "bool": "true or false", "int": "an integer", "number": "a number",
               "list": "a list", "dict": "an object", "stop": "a string or a list of strings",
               "ids": "a list of token ids (integers >= 0)"}


class OpenAIRequestError(TandemError, ValueError):
    """A request the OpenAI routes refuse (HTTP 400). `field` names the offending field (a path
    such as "messages[2].tool_calls[0].function.arguments"), None when the body as a whole is wrong."""

    status = 400

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.message, self.field = message, field


@dataclass
class ChatRequest:
    """A parsed `/v1/chat/completions` body. `messages` are normalised: roles in ROLES (OpenAI's
    "developer" becomes "system"), `content` a string (text parts joined with "\\n") or None
    (assistant only), assistant `tool_calls` as `[{id, type: "function", function: {name,
    arguments: JSON string}}]`. `tool_choice` is "auto" (tools given) or "none"."""

    model: str | None
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    tool_choice: str = "none"
    sampling: dict[str, Any] = field(default_factory=dict)
    stream: bool = False
    include_usage: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    user: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)  # extension (vLLM / SGLang)

    @property
    def parse_tools(self) -> bool:
        """Whether tools go into the prompt and calls are parsed out of the answer (tool_choice
        "none" leaves the tools out of the prompt)."""
        return self.tools is not None and self.tool_choice == "auto"

    @property
    def template_tools(self) -> list[dict[str, Any]] | None:
        return self.tools if self.parse_tools else None


@dataclass
class CompletionRequest:
    """A parsed `/v1/completions` body: one or more prompts (text or token ids), each answered
    with `n` choices (choice index = prompt * n + sample). `logprobs` k: each token's logprob and
    the k most likely alternatives (None: no logprobs)."""

    model: str | None
    prompts: list[str | list[int]]
    sampling: dict[str, Any] = field(default_factory=dict)
    stream: bool = False
    include_usage: bool = False
    logprobs: int | None = None
    user: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def new_call_id() -> str:
    """A tool call id in OpenAI's form."""
    return f"call_{uuid.uuid4().hex[:24]}"


# ---------------------------------------------------------------------------------------- checks
def _is_kind(value: Any, kind: str) -> bool:
    if kind == "int":
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == "number":
        return isinstance(value, int | float) and not isinstance(value, bool)
    if kind == "stop":
        return isinstance(value, str) or (isinstance(value, list) and all(isinstance(s, str) for s in value))
    if kind == "ids":
        return isinstance(value, list) and all(_is_kind(t, "int") and t >= 0 for t in value)
    return isinstance(value, {"str": str, "bool": bool, "list": list, "dict": dict}[kind])


def _get(body: dict[str, Any], name: str, kind: str, default: Any = None, where: str = "") -> Any:
    """body[name] if it has the JSON kind; absent or null: `default`."""
    value = body.get(name)
    if value is None:
        return default
    if not _is_kind(value, kind):
        raise OpenAIRequestError(f"field {where + name!r} must be {_KIND_NAMES[kind]}, got "
                                 f"{json.dumps(value)[:80]}", where + name)
    return value


def _check_known(body: dict[str, Any], known: frozenset[str] | set[str], where: str = "") -> None:
    unknown = sorted(set(body) - set(known))
    if unknown:
        place = f"in {where.rstrip('.')} " if where else ""
        raise OpenAIRequestError(f"unknown field(s) {place}{unknown}; valid fields: {sorted(known)}",
                                 where + unknown[0])


def _refuse_unless_neutral(body: dict[str, Any], refused: dict[str, str]) -> None:
    for name, why in refused.items():
        if body.get(name) not in (None, False, "", [], {}):
            raise OpenAIRequestError(f"field {name!r} = {json.dumps(body[name])[:80]} is not supported: {why}; "
                                     "drop it", name)


def _sampling(body: dict[str, Any]) -> dict[str, Any]:
    return {target: value for name, (target, kind) in SAMPLING_FIELDS.items()
            if (value := _get(body, name, kind)) is not None}


def _streaming(body: dict[str, Any]) -> tuple[bool, bool]:
    stream = _get(body, "stream", "bool", False)
    options = _get(body, "stream_options", "dict", {})
    _check_known(options, {"include_usage", "include_obfuscation"}, "stream_options.")
    return stream, stream and _get(options, "include_usage", "bool", False, "stream_options.")


def _extra(body: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in body.items() if k in HARMLESS_FIELDS}


_COMMON_REFUSED = {"logit_bias": "token biases are not applied by this server"}


# ---------------------------------------------------------------------------------------- chat
_CHAT_REFUSED = {
    **_COMMON_REFUSED,
    "functions": "the deprecated functions API is not served; send 'tools'",
    "function_call": "the deprecated functions API is not served; send 'tool_choice'",
    "audio": "text-only models", "prediction": "predicted outputs are not used",
    "web_search_options": "no web search here",
}
_CHAT_FIELDS = (_COMMON_FIELDS | HARMLESS_FIELDS | set(_CHAT_REFUSED)
                | {"messages", "tools", "tool_choice", "top_logprobs", "max_completion_tokens", "response_format",
                   "modalities", "chat_template_kwargs"})
_MESSAGE_FIELDS = {"role", "content", "name", "tool_calls", "tool_call_id", "reasoning_content"}
_NULL_MESSAGE_FIELDS = {"refusal", "audio", "function_call", "annotations"}  # SDK dumps carry them, empty
_TEMPLATE_RESERVED = {"messages", "tools", "documents", "add_generation_prompt", "tokenize", "conversation",
                      "continue_final_message", "return_dict", "chat_template"}


def parse_chat_request(body: dict[str, Any]) -> ChatRequest:
    if not isinstance(body, dict):
        raise OpenAIRequestError(f"the request body must be a JSON object, got {type(body).__name__}")
    _check_known(body, _CHAT_FIELDS)
    _refuse_unless_neutral(body, _CHAT_REFUSED)
    if _get(body, "modalities", "list", []) not in ([], ["text"]):
        raise OpenAIRequestError("field 'modalities' must be [\"text\"]: text-only models", "modalities")
    _response_format(body.get("response_format"))
    raw = _get(body, "messages", "list")
    if not raw:
        raise OpenAIRequestError("field 'messages' is required: a non-empty list of {\"role\": ..., \"content\": ...}",
                                 "messages")
    messages = [_message(i, m) for i, m in enumerate(raw)]
    tools = _tools(_get(body, "tools", "list"))
    tool_choice = _tool_choice(body.get("tool_choice"), tools)
    sampling = _sampling(body)
    limit = _get(body, "max_completion_tokens", "int")
    if limit is not None:
        if sampling.get("max_new_tokens", limit) != limit:
            raise OpenAIRequestError("fields 'max_tokens' and 'max_completion_tokens' differ; send one "
                                     "('max_completion_tokens', OpenAI's current name)", "max_completion_tokens")
        sampling["max_new_tokens"] = limit
    logprobs = _get(body, "logprobs", "bool", False)
    top = _get(body, "top_logprobs", "int", 0)
    if not 0 <= top <= MAX_TOP_LOGPROBS:
        raise OpenAIRequestError(f"field 'top_logprobs' must be in [0, {MAX_TOP_LOGPROBS}], got {top}", "top_logprobs")
    if top and not logprobs:
        raise OpenAIRequestError("field 'top_logprobs' needs 'logprobs': true", "top_logprobs")
    kwargs = _get(body, "chat_template_kwargs", "dict", {})
    if clash := sorted(set(kwargs) & _TEMPLATE_RESERVED):
        raise OpenAIRequestError(f"chat_template_kwargs may not set {clash}: they come from the request itself",
                                 "chat_template_kwargs")
    stream, include_usage = _streaming(body)
    return ChatRequest(model=_get(body, "model", "str"), messages=messages, tools=tools, tool_choice=tool_choice,
                       sampling=sampling, stream=stream, include_usage=include_usage, logprobs=logprobs,
                       top_logprobs=top, user=_get(body, "user", "str"), extra=_extra(body),
                       chat_template_kwargs=dict(kwargs))


def _response_format(value: Any) -> None:
    if value is None:
        return
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return
    if kind in ("json_object", "json_schema"):
        raise OpenAIRequestError(f"field 'response_format' of type {kind!r} is not supported: "
                                 f"{NO_CONSTRAINED_DECODING} to be valid JSON; drop 'response_format', ask for JSON in "
                                 "the prompt and validate the answer yourself", "response_format")
    raise OpenAIRequestError("field 'response_format' must be {\"type\": \"text\"} (json_object and json_schema are "
                             f"not supported), got {json.dumps(value)[:80]}", "response_format")


def _message(i: int, m: Any) -> dict[str, Any]:
    where = f"messages[{i}]."
    if not isinstance(m, dict):
        raise OpenAIRequestError(f"{where[:-1]} must be an object {{\"role\": ..., \"content\": ...}}", where[:-1])
    _check_known({k: v for k, v in m.items() if not (k in _NULL_MESSAGE_FIELDS and not v)}, _MESSAGE_FIELDS, where)
    role = "system" if m.get("role") == "developer" else m.get("role")
    if role not in ROLES:
        raise OpenAIRequestError(f"field '{where}role' must be one of {list(ROLES)}, got "
                                 f"{json.dumps(m.get('role'))[:40]}", where + "role")
    content = _content(m.get("content"), where + "content")
    if content is None and role != "assistant":
        raise OpenAIRequestError(f"field '{where}content' is required for a {role} message", where + "content")
    out: dict[str, Any] = {"role": role, "content": content}
    for name in ("name", "tool_call_id", "reasoning_content"):
        if (value := _get(m, name, "str", where=where)) is not None:
            out[name] = value
    if (calls := _get(m, "tool_calls", "list", where=where)) and role != "assistant":
        raise OpenAIRequestError(f"field '{where}tool_calls' is only valid in an assistant message", where + "tool_calls")
    if calls:
        out["tool_calls"] = [_tool_call(f"{where}tool_calls[{j}].", c) for j, c in enumerate(calls)]
    return out


def _content(value: Any, where: str) -> str | None:
    if value is None or isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise OpenAIRequestError(f"field {where!r} must be a string, null or a list of text parts", where)
    texts = []
    for j, part in enumerate(value):
        if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
            kind = part.get("type") if isinstance(part, dict) else None
            raise OpenAIRequestError(f"field '{where}[{j}]' must be {{\"type\": \"text\", \"text\": ...}}"
                                     + (f"; {kind!r} parts are not supported (text-only models)" if kind else ""),
                                     f"{where}[{j}]")
        texts.append(part["text"])
    return "\n".join(texts)


def _tool_call(where: str, call: Any) -> dict[str, Any]:
    if not isinstance(call, dict):
        raise OpenAIRequestError(f"{where[:-1]} must be an object {{\"id\", \"type\": \"function\", \"function\"}}",
                                 where[:-1])
    _check_known(call, {"id", "type", "function", "index"}, where)
    if call.get("type", "function") != "function":
        raise OpenAIRequestError(f"field '{where}type' must be \"function\"", where + "type")
    fn = _get(call, "function", "dict", where=where)
    if fn is None or not isinstance(fn.get("name"), str) or not fn["name"]:
        raise OpenAIRequestError(f"field '{where}function' must be {{\"name\": ..., \"arguments\": \"{{...}}\"}}",
                                 where + "function")
    args = fn.get("arguments", "{}")
    if isinstance(args, str):
        try:
            args = json.loads(args or "{}")
        except ValueError as exc:
            raise OpenAIRequestError(f"field '{where}function.arguments' is not valid JSON ({exc}); send the "
                                     "arguments object as a JSON string", where + "function.arguments") from exc
    if not isinstance(args, dict):
        raise OpenAIRequestError(f"field '{where}function.arguments' must encode a JSON object",
                                 where + "function.arguments")
    call_id = _get(call, "id", "str", where=where)
    return {"id": call_id or new_call_id(), "type": "function",
            "function": {"name": fn["name"], "arguments": json.dumps(args, ensure_ascii=False)}}


def _tools(tools: list[Any] | None) -> list[dict[str, Any]] | None:
    if not tools:
        return None
    out = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]."
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
            raise OpenAIRequestError(f"{where[:-1]} must be {{\"type\": \"function\", \"function\": {{\"name\", "
                                     "\"description\", \"parameters\"}}}} (only function tools are served)", where[:-1])
        _check_known(tool, {"type", "function"}, where)
        fn = tool["function"]
        _check_known(fn, {"name", "description", "parameters", "strict"}, where + "function.")
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise OpenAIRequestError(f"field '{where}function.name' must be a non-empty string", where + "function.name")
        _get(fn, "description", "str", where=where + "function.")
        _get(fn, "parameters", "dict", where=where + "function.")
        _get(fn, "strict", "bool", where=where + "function.")
        out.append({"type": "function", "function": dict(fn)})
    return out


def _tool_choice(value: Any, tools: list[dict[str, Any]] | None) -> str:
    if value is None:
        return "auto" if tools else "none"
    if value in ("auto", "none"):
        return value if tools else "none"
    if value == "required" or isinstance(value, dict):
        what = "'required'" if value == "required" else "a named function"
        raise OpenAIRequestError(f"field 'tool_choice' = {what} is not supported: {NO_CONSTRAINED_DECODING} to call a "
                                 "tool; send \"auto\" (the model decides; its calls come back in message.tool_calls) "
                                 "or \"none\"", "tool_choice")
    raise OpenAIRequestError(f"field 'tool_choice' must be \"auto\" or \"none\", got {json.dumps(value)[:80]}",
                             "tool_choice")


# ---------------------------------------------------------------------------------------- completions
_COMPLETION_REFUSED = {**_COMMON_REFUSED, "echo": "the prompt is not echoed",
                       "suffix": "no insertion (fill-in-the-middle) here"}
_COMPLETION_FIELDS = _COMMON_FIELDS | HARMLESS_FIELDS | set(_COMPLETION_REFUSED) | {"prompt", "best_of"}


def parse_completion_request(body: dict[str, Any]) -> CompletionRequest:
    if not isinstance(body, dict):
        raise OpenAIRequestError(f"the request body must be a JSON object, got {type(body).__name__}")
    _check_known(body, _COMPLETION_FIELDS)
    _refuse_unless_neutral(body, _COMPLETION_REFUSED)
    if _get(body, "best_of", "int", 1) != 1:
        raise OpenAIRequestError("field 'best_of' > 1 is not supported: send n and pick yourself", "best_of")
    if body.get("prompt") is None:
        raise OpenAIRequestError("field 'prompt' is required: a string, a list of token ids, or a list of those",
                                 "prompt")
    logprobs = _get(body, "logprobs", "int")
    if logprobs is not None and not 0 <= logprobs <= MAX_TOP_LOGPROBS:
        raise OpenAIRequestError(f"field 'logprobs' must be in [0, {MAX_TOP_LOGPROBS}], got {logprobs}", "logprobs")
    stream, include_usage = _streaming(body)
    return CompletionRequest(model=_get(body, "model", "str"), prompts=_prompts(body["prompt"]),
                             sampling=_sampling(body), stream=stream, include_usage=include_usage, logprobs=logprobs,
                             user=_get(body, "user", "str"), extra=_extra(body))


def _prompts(prompt: Any) -> list[str | list[int]]:
    def one(p: Any) -> str | list[int]:
        if isinstance(p, str) or (isinstance(p, list) and p and _is_kind(p, "ids")):
            return p
        raise OpenAIRequestError("field 'prompt' must be a string, a non-empty list of token ids (integers >= 0), "
                                 "or a list of those", "prompt")

    if isinstance(prompt, list) and prompt and all(isinstance(p, str | list) for p in prompt):
        return [one(p) for p in prompt]
    return [one(prompt)]

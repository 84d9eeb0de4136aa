"""The SGLang HTTP API's request parsing and response shapes (docs/inference.md, HTTP server).

Errors: `ApiError` answers `{"object":"error","message":...,"type":...,"code":...}`; `ControlError`
answers a control route's `{"success": false, "message": ...}` with 400.
"""

from __future__ import annotations

import base64
import json
import re
from collections.abc import Callable
from typing import Any

import torch
from starlette.requests import Request
from starlette.responses import JSONResponse

from tandem.inference.outputs import RequestOutput

ERROR_TYPES = {400: "Bad Request", 401: "Unauthorized", 403: "Forbidden", 404: "Not Found",
               500: "Internal Server Error", 503: "Service Unavailable"}


class ApiError(Exception):
    def __init__(self, message: str, code: int = 400):
        super().__init__(message)
        self.message, self.code = message, code

    def response(self) -> JSONResponse:
        return error_response(self.message, self.code)


class ControlError(Exception):
    """A control route failed: `{"success": false, "message": ...}`, status 400."""


def error_body(message: str, code: int = 400) -> dict[str, Any]:
    return {"object": "error", "message": message, "type": ERROR_TYPES.get(code, "Error"), "code": code}


def error_response(message: str, code: int = 400) -> JSONResponse:
    return JSONResponse(error_body(message, code), status_code=code)


def control_response(success: bool, message: str, **extra: Any) -> JSONResponse:
    return JSONResponse({"success": success, "message": message, **extra}, status_code=200 if success else 400)


async def read_json(request: Request, *, allow_empty: bool = True) -> dict[str, Any]:
    """The body as a JSON object; an empty body is `{}` when allowed. 400 on anything else."""
    raw = await request.body()
    if not raw.strip():
        if allow_empty:
            return {}
        raise ApiError("the request body is empty; send a JSON object")
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ApiError(f"malformed JSON body: {exc}") from exc
    if not isinstance(body, dict):
        raise ApiError(f"the request body must be a JSON object, got {type(body).__name__}")
    return body


_TYPE_NAMES = {str: "a string", bool: "true or false", int: "an integer", float: "a number",
               list: "a list", dict: "an object"}


def get_field(body: dict[str, Any], name: str, kind: type | tuple[type, ...], default: Any = None,
              *, required: bool = False, where: str = "") -> Any:
    """body[name] checked against `kind` (bool is never an int; int is a float); null = default."""
    if name not in body or body[name] is None:
        if required:
            raise ApiError(f"field {where}{name!r} is required")
        return default
    value = body[name]
    kinds = kind if isinstance(kind, tuple) else (kind,)
    ok = any(
        (isinstance(value, k) and not (isinstance(value, bool) and k in (int, float)))
        or (k is float and isinstance(value, int) and not isinstance(value, bool))
        for k in kinds
    )
    if not ok:
        names = " or ".join(_TYPE_NAMES.get(k, k.__name__) for k in kinds)
        raise ApiError(f"field {where}{name!r} must be {names}, got {json.dumps(value)[:80]}")
    return value


_INTEGER = re.compile(r"-?[0-9]+")


def version_of(value: str, name: str) -> int:
    """A weight version as field `name` sent it: an integer in a string ("7", SGLang's form;
    answers carry it the same way). Anything else is a 400 naming the field."""
    if _INTEGER.fullmatch(value) is None:
        raise ApiError(f"field {name!r} must be an integer (e.g. \"7\"), got {json.dumps(value)[:80]}")
    return int(value)


def get_version(body: dict[str, Any], name: str) -> int | None:
    """body[name] as a weight version (`version_of`); absent or null = None."""
    value = get_field(body, name, str)
    return None if value is None else version_of(value, name)


def check_fields(body: dict[str, Any], known: set[str], where: str = "request") -> None:
    unknown = sorted(set(body) - known)
    if unknown:
        raise ApiError(f"unknown {where} field(s) {unknown}; valid fields: {sorted(known)}")


def token_ids(value: Any, name: str) -> list[int]:
    if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        raise ApiError(f"field {name!r} must be a list of token ids (integers)")
    return value


TextOf = Callable[[int], "str | None"]  # a token id's text in logprob entries (return_text_in_logprobs)


def _no_text(_: int) -> None:
    return None


def logprob_entries(logprobs: list[float | None], ids: list[int], text_of: TextOf = _no_text) -> list[list[Any]]:
    """SGLang's `[[logprob, token id, text or null], ...]`."""
    return [[lp, t, text_of(t)] for lp, t in zip(logprobs, ids, strict=True)]


def top_entries(tops: list[list[tuple[float, int]] | None], text_of: TextOf = _no_text) -> list[list[list[Any]] | None]:
    """SGLang's top-logprob lists: per position null or `[[logprob, token id, text or null], ...]`."""
    return [None if top is None else [[lp, t, text_of(t)] for lp, t in top] for top in tops]


def meta_info(out: RequestOutput, rid: str, return_logprob: bool, *, finished: bool = True,
              weight_version: int | None = None, prompt_ids: list[int] | None = None,
              text_of: TextOf = _no_text) -> dict[str, Any]:
    """SGLang's meta_info. With return_logprob: `input_token_logprobs` (the prompt's from
    logprob_start_len, [] without it; `prompt_ids` are the prompt) and `output_token_logprobs`;
    with top_logprobs_num also `input_top_logprobs` and `output_top_logprobs`."""
    meta: dict[str, Any] = {
        "id": rid,
        "prompt_tokens": out.prompt_tokens,
        "completion_tokens": out.completion_tokens,
        "cached_tokens": out.cached_tokens,
        "weight_version": str(out.weight_version if weight_version is None else weight_version),
        "e2e_latency": out.e2e_latency,
        "finish_reason": out.finish_reason if finished else None,
    }
    if return_logprob and out.output_logprobs is not None:
        inputs = out.input_logprobs or []
        start = (len(prompt_ids) - len(inputs)) if prompt_ids is not None else 0
        meta["input_token_logprobs"] = logprob_entries(inputs, (prompt_ids or [])[start:], text_of) if inputs else []
        meta["output_token_logprobs"] = logprob_entries(out.output_logprobs, out.output_ids, text_of)
        if out.output_top_logprobs is not None:
            meta["input_top_logprobs"] = top_entries(out.input_top_logprobs or [], text_of)
            meta["output_top_logprobs"] = top_entries(list(out.output_top_logprobs), text_of)
    if out.routed_experts is not None:
        meta["routed_experts"] = encode_routed_experts(out.routed_experts)
    return meta


def encode_routed_experts(routes: torch.Tensor) -> str:
    """SGLang's wire form of `return_routed_experts` (docs/inference.md): the base64 of the
    `[prompt + output tokens - 1, num_hidden_layers, top_k]` int32 array's bytes, row-major,
    little-endian. Decoded by `tandem.fleet.routed_experts.decode_routed_experts`."""
    array = routes.to(torch.int32).contiguous().numpy()
    return base64.b64encode(array.astype("<i4", copy=False).tobytes()).decode("ascii")


def generate_response(out: RequestOutput, rid: str, return_logprob: bool, n: int, *,
                      prompt_ids: list[int] | None = None, text_of: TextOf = _no_text) -> dict[str, Any]:
    body = {"text": out.text or "", "output_ids": out.output_ids,
            "meta_info": meta_info(out, rid, return_logprob, prompt_ids=prompt_ids, text_of=text_of)}
    if n > 1:
        body["index"] = out.index
    return body

"""OpenAI-compatible routes for agent code: /v1/completions, /v1/chat/completions, /v1/models.

Non-streaming only. `prompt` may be a string, a list of token ids, or a list of either; each
prompt yields `n` choices (index = prompt * n + sample). `logprobs: k` returns each sampled token's
logprob; `top_logprobs` holds just that token (the engine keeps no alternatives).
Extensions: `top_k`, `stop_token_ids`, `ignore_eos`, `min_tokens`, `seed`.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

from fastapi import APIRouter, Request
from starlette.responses import JSONResponse, Response

from tandem.inference.outputs import RequestOutput
from tandem.inference.server.protocol import ApiError, check_fields, get_field, read_json
from tandem.inference.server.routes import sampling_params, state_of
from tandem.inference.server.state import ClientGone, ServerState

router = APIRouter()

SAMPLING_FIELDS = {  # OpenAI name -> SamplingParams name
    "max_tokens": "max_new_tokens", "temperature": "temperature", "top_p": "top_p", "n": "n", "stop": "stop",
    "top_k": "top_k", "stop_token_ids": "stop_token_ids", "ignore_eos": "ignore_eos", "min_tokens": "min_new_tokens",
    "seed": "seed", "frequency_penalty": "frequency_penalty", "presence_penalty": "presence_penalty",
    "skip_special_tokens": "skip_special_tokens",
}
COMMON_FIELDS = set(SAMPLING_FIELDS) | {"model", "stream", "user", "logprobs"}
FINISH = {"stop": "stop", "length": "length", "abort": "abort"}


def _params(body: dict[str, Any], default_max_tokens: int):
    raw = {SAMPLING_FIELDS[k]: v for k, v in body.items() if k in SAMPLING_FIELDS and v is not None}
    raw.setdefault("max_new_tokens", default_max_tokens)
    return sampling_params(raw, where="request")


def _check_common(body: dict[str, Any]) -> None:
    get_field(body, "model", str)
    if get_field(body, "stream", bool, False):
        raise ApiError("stream is not supported on the /v1 routes; use /generate with stream: true")


async def _run_all(request: Request, state: ServerState, prompts: list[list[int]], params, want_logprob: bool):
    rid = f"cmpl-{uuid.uuid4().hex}"
    tasks = [state.run_request(request, f"{rid}-{i}", ids, params, want_logprob) for i, ids in enumerate(prompts)]
    results = await asyncio.gather(*tasks, return_exceptions=True)
    for r in results:
        if isinstance(r, BaseException):
            state.engine_loop.abort(rid, abort_all=False)  # the others, by prefix
            raise r
    return rid, results


def _usage(prompts: list[list[int]], outs: list[list[RequestOutput]]) -> dict[str, int]:
    prompt = sum(len(p) for p in prompts)
    completion = sum(o.completion_tokens for group in outs for o in group)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _logprobs(state: ServerState, out: RequestOutput) -> dict[str, Any]:
    tok = state.tokenizer
    tokens = [tok.decode([t]) if tok is not None else f"token_id:{t}" for t in out.output_ids]
    lps = out.output_logprobs or []
    offsets, pos = [], 0
    for t in tokens:
        offsets.append(pos)
        pos += len(t)
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": [{t: lp} for t, lp in zip(tokens, lps, strict=False)],
            "text_offset": offsets}


def _prompts(state: ServerState, prompt: Any) -> list[list[int]]:
    def one(p: Any) -> list[int]:
        if isinstance(p, str):
            return state.encode(p)
        if isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
            return p
        raise ApiError("prompt must be a string, a list of token ids, or a list of those")

    if isinstance(prompt, list) and prompt and all(isinstance(p, str | list) for p in prompt):
        return [one(p) for p in prompt]
    return [one(prompt)]


@router.post("/v1/completions")
async def completions(request: Request) -> Response:
    state = state_of(request)
    state.check_ready()
    body = await read_json(request, allow_empty=False)
    check_fields(body, COMMON_FIELDS | {"prompt", "echo", "best_of", "suffix", "logit_bias"})
    _check_common(body)
    if body.get("echo") or body.get("suffix") or body.get("logit_bias") or get_field(body, "best_of", int, 1) > 1:
        raise ApiError("echo, suffix, logit_bias and best_of are not supported")
    if "prompt" not in body:
        raise ApiError("field 'prompt' is required")
    prompts = _prompts(state, body["prompt"])
    logprobs = get_field(body, "logprobs", int)
    params = _params(body, default_max_tokens=16)
    try:
        rid, outs = await _run_all(request, state, prompts, params, logprobs is not None)
    except ClientGone:
        return Response(status_code=499)
    choices = []
    for i, group in enumerate(outs):
        for out in group:
            choices.append({"index": i * params.n + out.index, "text": out.text or "",
                            "logprobs": _logprobs(state, out) if logprobs is not None else None,
                            "finish_reason": FINISH[out.finish_reason["type"]],
                            "matched_stop": out.finish_reason.get("matched")})
    return JSONResponse({"id": rid, "object": "text_completion", "created": int(time.time()),
                         "model": state.args.model_name, "choices": choices, "usage": _usage(prompts, outs)})


@router.post("/v1/chat/completions")
async def chat_completions(request: Request) -> Response:
    state = state_of(request)
    state.check_ready()
    body = await read_json(request, allow_empty=False)
    check_fields(body, COMMON_FIELDS | {"messages", "max_completion_tokens", "top_logprobs"})
    _check_common(body)
    messages = get_field(body, "messages", list, required=True)
    if not messages or not all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages):
        raise ApiError("messages must be a non-empty list of {'role': ..., 'content': ...} objects")
    tok = state.tokenizer
    if tok is None or not getattr(tok, "chat_template", None):
        raise ApiError("this model's tokenizer has no chat template")
    try:
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except Exception as exc:
        raise ApiError(f"cannot apply the chat template: {exc}") from exc
    ids = state.encode(text)
    if body.get("max_completion_tokens") is not None and body.get("max_tokens") is None:
        body = {**body, "max_tokens": body["max_completion_tokens"]}
    want_logprobs = get_field(body, "logprobs", bool, False)
    params = _params({k: v for k, v in body.items() if k != "max_completion_tokens"}, default_max_tokens=128)
    try:
        rid, outs = await _run_all(request, state, [ids], params, want_logprobs)
    except ClientGone:
        return Response(status_code=499)
    choices = []
    for out in outs[0]:
        lp = None
        if want_logprobs:
            d = _logprobs(state, out)
            lp = {"content": [{"token": t, "logprob": v, "bytes": list(t.encode()), "top_logprobs": []}
                              for t, v in zip(d["tokens"], d["token_logprobs"], strict=False)]}
        choices.append({"index": out.index, "message": {"role": "assistant", "content": out.text or ""},
                        "logprobs": lp, "finish_reason": FINISH[out.finish_reason["type"]],
                        "matched_stop": out.finish_reason.get("matched")})
    return JSONResponse({"id": rid.replace("cmpl", "chatcmpl", 1), "object": "chat.completion",
                         "created": int(time.time()), "model": state.args.model_name, "choices": choices,
                         "usage": _usage([ids], outs)})


@router.get("/v1/models")
async def models(request: Request) -> Response:
    state = state_of(request)
    state.check_ready()
    return JSONResponse({"object": "list", "data": [{
        "id": state.args.model_name, "object": "model", "created": int(state.started), "owned_by": "tandem",
        "root": state.args.model_path, "max_model_len": state.engine.max_model_len,
    }]})

"""SGLang's /generate (plain and SSE) as real clients send it: every `GenerateReqInput` field is
sorted by sglang_fields; prompt logprobs from `logprob_start_len`, top logprobs, abort answers
shaped as SGLang's (docs/inference.md)."""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from tandem.inference.engine import LLMEngine
from tandem.inference.errors import RequestError
from tandem.inference.outputs import RequestOutput
from tandem.inference.request import GenerationRequest
from tandem.inference.sampler import logprob_temperature
from tandem.inference.server.http_api import (
    ApiError,
    error_body,
    generate_response,
    get_field,
    read_json,
    token_ids,
)
from tandem.inference.server.routes import sampling_params, state_of
from tandem.inference.server.sglang_fields import check_generate
from tandem.inference.server.state import ClientGone, ServerState, failure

router = APIRouter()


@dataclass(frozen=True)
class SglangGenerate:
    """One parsed SGLang /generate request (docs/inference.md, "SGLang fields"): what the engine
    runs (`request`, handed on unchanged) and what only shapes the answer."""

    request: GenerationRequest
    return_text_in_logprobs: bool
    routed_experts_start_len: int
    prefill_only: bool  # max_new_tokens 0: no token is generated (SGLang allows it)


def parse_generate(state: ServerState, raw: dict[str, Any]) -> SglangGenerate:
    body = check_generate(raw)
    rid = get_field(body, "rid", (str, list)) or state.new_rid()
    if isinstance(rid, list):
        raise ApiError("a list 'rid' means a batched /generate, which is not supported; send one request per prompt")
    if isinstance(body.get("input_ids"), list) and body["input_ids"] and isinstance(body["input_ids"][0], list):
        raise ApiError("batched /generate is not supported; send one request per prompt")
    if isinstance(body.get("text"), list):
        raise ApiError("a list 'text' means a batched /generate, which is not supported; send one request per prompt")
    if body.get("input_ids") is not None:
        input_ids = token_ids(body["input_ids"], "input_ids")
    elif (text := get_field(body, "text", str)) is not None:
        input_ids = state.encode(text)
    else:
        raise ApiError("send 'input_ids' (a list of token ids) or 'text'")
    raw_params = body.get("sampling_params")
    prefill_only = isinstance(raw_params, dict) and raw_params.get("max_new_tokens") == 0 \
        and not isinstance(raw_params.get("max_new_tokens"), bool)
    if prefill_only:
        raw_params = {**raw_params, "max_new_tokens": 1}
    params = sampling_params(raw_params)
    return_logprob = get_field(body, "return_logprob", bool, False)
    start = get_field(body, "logprob_start_len", int, -1)
    top_n = get_field(body, "top_logprobs_num", int, 0)
    if start < -1 or start >= len(input_ids):
        raise ApiError(f"field 'logprob_start_len' = {start} must be -1 (output logprobs only) or in "
                       f"[0, {len(input_ids) - 1}] (the prompt has {len(input_ids)} tokens)")
    if top_n < 0:
        raise ApiError(f"field 'top_logprobs_num' = {top_n} must be >= 0")
    want_experts = get_field(body, "return_routed_experts", bool, False)
    if want_experts and not state.engine.has_routed_experts:
        raise ApiError(f"return_routed_experts needs a mixture-of-experts model; {state.args.model_path} routes "
                       "no experts: drop the field")
    experts_start = get_field(body, "routed_experts_start_len", int, 0)
    if not 0 <= experts_start <= len(input_ids):
        raise ApiError(f"field 'routed_experts_start_len' = {experts_start} must be in [0, {len(input_ids)}] "
                       "(the prompt's length)")
    stream = get_field(body, "stream", bool, False)
    text_logprobs = get_field(body, "return_text_in_logprobs", bool, False)
    if text_logprobs and state.engine.detokenizer.tokenizer is None:
        raise ApiError("return_text_in_logprobs needs a tokenizer; the model directory has none: drop the field")
    if prefill_only and stream:
        raise ApiError("sampling_params.max_new_tokens = 0 with stream: true is not supported; send stream: false")
    request = GenerationRequest(rid, input_ids, params, return_logprob, stream, return_routed_experts=want_experts,
                                top_logprobs_num=top_n, logprob_start_len=start)
    return SglangGenerate(request, text_logprobs, experts_start, prefill_only)


def respond(state: ServerState, call: SglangGenerate, out: RequestOutput) -> dict[str, Any]:
    """The SGLang answer for one finished sample of `call`."""
    req = call.request
    if call.routed_experts_start_len and out.routed_experts is not None:
        out = dataclasses.replace(out, routed_experts=out.routed_experts[call.routed_experts_start_len:])
    detok = state.engine.detokenizer
    text_of = (lambda t: detok.decode([t], False)) if call.return_text_in_logprobs else None
    extra = {"text_of": text_of} if text_of is not None else {}
    return generate_response(out, req.rid, req.return_logprob, req.params.n, prompt_ids=req.input_ids, **extra)


@router.post("/generate")
async def generate(request: Request) -> Response:
    state = state_of(request)
    state.check_ready()
    call = parse_generate(state, await read_json(request, allow_empty=False))
    if call.prefill_only:
        outs = await _prefill_only(state, call.request)
    elif call.request.stream:
        return await _stream(state, call)
    else:
        try:
            outs = await state.run_request(request, call.request)
        except ClientGone:
            return Response(status_code=499)
    items = [respond(state, call, o) for o in outs]
    return JSONResponse(items if call.request.params.n > 1 else items[0])


async def _prefill_only(state: ServerState, req: GenerationRequest) -> list[RequestOutput]:
    """max_new_tokens 0 (SGLang: score the prompt, generate nothing): after the gate, the prompt's
    logprobs on the engine thread; finish reason length 0 for each of the n samples."""
    if req.return_routed_experts:
        raise ApiError("return_routed_experts with max_new_tokens 0 is not supported; generate at least one token")
    held = await state.wait_gate(req)
    if held is not None:
        return held
    temperature = logprob_temperature(req.params)

    def score(engine: LLMEngine) -> tuple[Any, Any, int]:
        engine.check_request(req.input_ids, req.params)
        if not (req.return_logprob and req.logprob_start_len >= 0):
            return None, None, engine.weight_version
        lps, tops = engine.prompt_logprobs(req.input_ids, req.logprob_start_len, temperature, req.top_logprobs_num)
        return lps, tops, engine.weight_version

    started = time.monotonic()
    try:
        lps, tops, version = await state.engine_loop.call(score)
    except RequestError as exc:
        raise ApiError(str(exc)) from exc
    want_top = req.return_logprob and req.top_logprobs_num > 0
    return [RequestOutput(rid=req.rid, index=i, output_ids=[], output_logprobs=[] if req.return_logprob else None,
                          finish_reason={"type": "length", "length": 0}, prompt_tokens=len(req.input_ids),
                          cached_tokens=0, weight_version=version, e2e_latency=time.monotonic() - started,
                          text="", output_top_logprobs=[] if want_top else None, input_logprobs=lps,
                          input_top_logprobs=tops if want_top else None)
            for i in range(req.params.n)]


async def _stream(state: ServerState, call: SglangGenerate) -> Response:
    """SSE events; with return_routed_experts only each sample's final event carries the routes,
    and top logprobs and prompt logprobs come in each sample's final event only."""
    req = call.request
    rid, input_ids, params, return_logprob = req.rid, req.input_ids, req.params, req.return_logprob
    submitted = await state.submit(req)
    if isinstance(submitted, list):  # aborted while held at the gate

        async def held():
            for out in submitted:
                yield _sse(respond(state, call, out))
            yield "data: [DONE]\n\n"

        return StreamingResponse(held(), media_type="text/event-stream")
    detok = state.engine.detokenizer

    async def events():
        so_far: dict[int, tuple[list[int], list[float]]] = {}
        async for kind, item in state.stream_request(submitted):
            if kind == "final" and (failed := failure([item])) is not None:
                yield _sse(error_body(failed, 500))  # the status (200) went out with the first byte
                break
            if kind == "final":
                yield _sse(respond(state, call, item))
                continue
            ids, lps = so_far.setdefault(item.index, ([], []))
            ids += item.token_ids
            lps += item.logprobs
            meta = {"id": rid, "prompt_tokens": len(input_ids), "completion_tokens": len(ids),
                    "cached_tokens": 0, "weight_version": str(state.engine.weight_version), "e2e_latency": None,
                    "finish_reason": None}
            if return_logprob:
                meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(lps, ids, strict=True)]
            text = detok.decode(ids, params.skip_special_tokens) if detok.tokenizer is not None else ""
            event = {"text": text, "output_ids": list(ids), "meta_info": meta}
            if params.n > 1:
                event["index"] = item.index
            yield _sse(event)
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj)}\n\n"

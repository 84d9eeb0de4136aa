"""SGLang-native routes: /generate (plain and SSE), health and info, pause/continue/abort, cache."""

from __future__ import annotations

import json
from typing import Any

from fastapi import APIRouter, Request
from starlette.responses import JSONResponse, Response, StreamingResponse

import tandem
from tandem.inference.engine import LLMEngine
from tandem.inference.errors import EngineBusyError, RequestError
from tandem.inference.sampling_params import SamplingParams
from tandem.inference.server.protocol import (
    ApiError,
    ControlError,
    check_fields,
    control_response,
    error_body,
    generate_response,
    get_field,
    read_json,
    token_ids,
    version_of,
)
from tandem.inference.server.state import ClientGone, ServerState, failure

router = APIRouter()

GENERATE_FIELDS = {"rid", "input_ids", "text", "sampling_params", "return_logprob", "stream", "return_routed_experts"}
# Sent by some SGLang clients; accepted and ignored (this server has no multimodal/LoRA/top-logprob paths).
IGNORED_GENERATE_FIELDS = {"logprob_start_len", "top_logprobs_num", "return_text_in_logprobs", "lora_path",
                           "image_data", "return_hidden_states", "custom_logit_processor", "data_parallel_rank"}


def state_of(request: Request) -> ServerState:
    return request.app.state.tandem


def sampling_params(raw: Any, where: str = "sampling_params") -> SamplingParams:
    if raw is not None and not isinstance(raw, dict):
        raise ApiError(f"field {where!r} must be an object")
    try:
        return SamplingParams.from_dict(raw)
    except RequestError as exc:
        raise ApiError(str(exc)) from exc
    except TypeError as exc:
        raise ApiError(f"invalid {where}: {exc}") from exc


@router.post("/generate")
async def generate(request: Request) -> Response:
    state = state_of(request)
    state.check_ready()
    body = await read_json(request, allow_empty=False)
    check_fields(body, GENERATE_FIELDS | IGNORED_GENERATE_FIELDS)
    rid = get_field(body, "rid", str) or state.new_rid()
    if isinstance(body.get("input_ids"), list) and body["input_ids"] and isinstance(body["input_ids"][0], list):
        raise ApiError("batched /generate is not supported; send one request per prompt")
    if body.get("input_ids") is not None:
        input_ids = token_ids(body["input_ids"], "input_ids")
    elif (text := get_field(body, "text", str)) is not None:
        input_ids = state.encode(text)
    else:
        raise ApiError("send 'input_ids' (a list of token ids) or 'text'")
    params = sampling_params(body.get("sampling_params"))
    return_logprob = get_field(body, "return_logprob", bool, False)
    routes = get_field(body, "return_routed_experts", bool, False)
    if routes and not state.engine.routes_experts:
        raise ApiError(f"return_routed_experts needs a mixture-of-experts model; {state.args.model_path} routes "
                       "no experts: drop the field")
    if get_field(body, "stream", bool, False):
        return await _stream(state, rid, input_ids, params, return_logprob, routes)
    try:
        outs = await state.run_request(request, rid, input_ids, params, return_logprob, routes)
    except ClientGone:
        return Response(status_code=499)
    items = [generate_response(o, rid, return_logprob, params.n) for o in outs]
    return JSONResponse(items if params.n > 1 else items[0])


async def _stream(state: ServerState, rid: str, input_ids: list[int], params: SamplingParams,
                  return_logprob: bool, return_routed_experts: bool) -> Response:
    """SSE events; with return_routed_experts only each sample's final event carries the routes."""
    submitted = await state.submit(rid, input_ids, params, return_logprob, stream=True,
                                   return_routed_experts=return_routed_experts)
    if isinstance(submitted, list):  # aborted while held at the gate

        async def held():
            for out in submitted:
                yield _sse(generate_response(out, rid, return_logprob, params.n))
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
                yield _sse(generate_response(item, rid, return_logprob, params.n))
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


@router.get("/health")
async def health(request: Request) -> Response:
    loop = state_of(request).engine_loop
    if loop.error:
        return JSONResponse({"status": "broken", "message": loop.error.splitlines()[0]}, status_code=503)
    if not loop.ready.is_set():
        return JSONResponse({"status": "starting"}, status_code=503)
    return JSONResponse({"status": "ok", "weight_version": str(state_of(request).engine.weight_version)})


@router.get("/get_model_info")
async def get_model_info(request: Request) -> Response:
    state = state_of(request)
    state.check_ready()
    path = state.args.model_path
    return JSONResponse({"model_path": path, "tokenizer_path": path if state.tokenizer is not None else None,
                         "is_generation": True, "weight_version": str(state.engine.weight_version)})


@router.get("/get_server_info")
async def get_server_info(request: Request) -> Response:
    state = state_of(request)
    state.check_ready()
    engine = state.engine
    stats = await state.engine_loop.call(lambda e: e.stats())
    return JSONResponse({
        **state.args.public(),
        "version": tandem.__version__,
        "max_total_num_tokens": engine.max_total_num_tokens,
        "max_req_input_len": min(engine.max_model_len, engine.max_total_num_tokens) - 1,
        "max_model_len": engine.max_model_len,
        "weight_version": str(engine.weight_version),
        "paused": state.paused,
        "memory_released": sorted(state.released),
        "waiting_at_gate": len(state.waiting),
        "engine_stats": {**stats, "weight_version": str(stats["weight_version"])},
    })


@router.get("/get_weight_version")
async def get_weight_version(request: Request) -> Response:
    state = state_of(request)
    state.check_ready()
    return JSONResponse({"weight_version": str(state.engine.weight_version)})


@router.post("/update_weight_version")
async def update_weight_version(request: Request) -> Response:
    state = state_of(request)
    state.check_ready()
    body = await read_json(request)
    check_fields(body, {"new_version", "abort_all_requests"})
    version = version_of(get_field(body, "new_version", str, required=True), "new_version")
    if get_field(body, "abort_all_requests", bool, False):
        await state.engine_loop.abort(abort_all=True)

    def apply(engine: LLMEngine) -> None:
        engine.weight_version = version

    await state.engine_loop.call(apply)
    return control_response(True, f"weight version is now '{version}'")


@router.api_route("/flush_cache", methods=["GET", "POST"])
async def flush_cache(request: Request) -> Response:
    state = state_of(request)
    state.check_ready()
    try:
        await state.engine_loop.call(lambda e: e.flush_cache())
    except EngineBusyError as exc:
        raise ControlError(str(exc)) from exc
    return control_response(True, "prefix cache flushed")


@router.post("/pause_generation")
async def pause_generation(request: Request) -> Response:
    """mode "abort" (default): in-flight requests are answered abort with their partial output.
    mode "in_place": they stay in the engine, which stops stepping until continue. Either way new
    requests wait at the gate until /continue_generation."""
    state = state_of(request)
    state.check_ready()
    body = await read_json(request)
    check_fields(body, {"mode"})
    mode = get_field(body, "mode", str, "abort")
    if mode not in ("abort", "in_place"):
        raise ApiError(f"pause mode {mode!r} is not supported; use 'abort' or 'in_place'")
    state.paused = True
    state.update_gate()
    if mode == "abort":
        aborted = await state.engine_loop.abort(abort_all=True)
        return control_response(True, f"generation paused; {len(aborted)} in-flight request(s) aborted")
    await state.engine_loop.set_hold(True)
    return control_response(True, "generation paused in place")


@router.post("/continue_generation")
async def continue_generation(request: Request) -> Response:
    state = state_of(request)
    state.check_ready()
    body = await read_json(request)
    check_fields(body, set())
    state.paused = False
    state.update_gate()
    if "kv_cache" not in state.released:
        await state.engine_loop.set_hold(False)
    return control_response(True, "generation continued")


@router.post("/abort_request")
async def abort_request(request: Request) -> Response:
    state = state_of(request)
    state.check_ready()
    body = await read_json(request)
    check_fields(body, {"rid", "abort_all"})
    rid = get_field(body, "rid", str, "")
    abort_all = get_field(body, "abort_all", bool, False)
    if not rid and not abort_all:
        raise ApiError("send a 'rid' (prefix) or 'abort_all': true")
    held = state.abort_waiting(rid, abort_all)
    aborted = await state.engine_loop.abort(rid, abort_all=abort_all)
    return control_response(True, f"aborted {len(aborted) + held} request(s)", rids=aborted)


@router.post("/get_weights_by_name")
async def get_weights_by_name(request: Request) -> Response:
    state = state_of(request)
    state.check_ready()
    body = await read_json(request)
    check_fields(body, {"name", "truncate_size"})
    name = get_field(body, "name", str, required=True)
    size = get_field(body, "truncate_size", int, 100)
    if "weights" in state.released:
        raise ApiError("weights are released; call /resume_memory_occupation first")
    try:
        values = await state.engine_loop.call(lambda e: e.get_weights_by_name(name, size))
    except ValueError as exc:
        raise ApiError(str(exc)) from exc
    return JSONResponse(values)

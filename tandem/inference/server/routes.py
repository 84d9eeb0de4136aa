"""SGLang-native control routes: health and info, pause/continue/abort, cache, weight version
(/generate lives in generate_route)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from starlette.responses import JSONResponse, Response

import tandem
from tandem.inference.engine import LLMEngine
from tandem.inference.errors import EngineBusyError, RequestError
from tandem.inference.sampling_params import SamplingParams
from tandem.inference.server.http_api import (
    ApiError,
    ControlError,
    check_fields,
    control_response,
    get_field,
    read_json,
    version_of,
)
from tandem.inference.server.sglang_fields import check_sampling
from tandem.inference.server.state import ServerState

router = APIRouter()

def state_of(request: Request) -> ServerState:
    return request.app.state.tandem


def sampling_params(raw: Any, where: str = "sampling_params") -> SamplingParams:
    """SGLang's sampling_params object as tandem's SamplingParams (sglang_fields.check_sampling:
    unknown or refused fields are 400s naming them)."""
    if raw is not None and not isinstance(raw, dict):
        raise ApiError(f"field {where!r} must be an object")
    try:
        return SamplingParams.from_dict(check_sampling(raw or {}, where))
    except RequestError as exc:
        raise ApiError(str(exc)) from exc
    except TypeError as exc:
        raise ApiError(f"invalid {where}: {exc}") from exc


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
    state.check_ready(generation=False)
    path = state.args.model_path
    return JSONResponse({"model_path": path, "tokenizer_path": path if state.tokenizer is not None else None,
                         "is_generation": not state.args.is_embedding,
                         "weight_version": str(state.engine.weight_version)})


@router.get("/get_server_info")
async def get_server_info(request: Request) -> Response:
    state = state_of(request)
    state.check_ready(generation=False)
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
    state.check_ready(generation=False)
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

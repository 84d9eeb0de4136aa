"""Memory routes for colocated training: `/release_memory_occupation` closes the generation gate
and frees the KV cache and/or moves the weights to host memory; `/resume_memory_occupation` undoes
it. The work runs on the engine thread (`memory.py`); both hold the weight-update lock.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from starlette.responses import Response

from tandem.inference.errors import EngineBusyError
from tandem.inference.server.http_api import (
    ApiError,
    ControlError,
    check_fields,
    control_response,
    get_field,
    read_json,
)
from tandem.inference.server.memory import MEMORY_TAGS, release_memory, resume_memory
from tandem.inference.server.routes import state_of
from tandem.inference.server.state import ServerState

router = APIRouter()


async def _memory_request(request: Request) -> tuple[ServerState, list[str]]:
    """The server's state (ready) and the request's `tags` (default: all), each a known tag."""
    state = state_of(request)
    state.check_ready()
    body = await read_json(request)
    check_fields(body, {"tags"})
    tags = get_field(body, "tags", list, list(MEMORY_TAGS))
    bad = [t for t in tags if t not in MEMORY_TAGS]
    if bad:
        raise ApiError(f"unknown memory tag(s) {bad}; valid tags: {list(MEMORY_TAGS)}")
    return state, tags


@router.post("/release_memory_occupation")
async def release_memory_occupation(request: Request) -> Response:
    """`{"tags"?: ["kv_cache", "weights"]}` (default both). 400 while requests are in flight."""
    state, tags = await _memory_request(request)
    async with state.weights.lock:
        before = set(state.released)
        state.released |= set(tags)
        state.update_gate()  # new requests wait until resumed
        try:
            await state.engine_loop.call(lambda e: release_memory(e, tags, state.host_memory))
        except EngineBusyError as exc:
            state.released = before
            state.update_gate()
            raise ControlError(str(exc)) from exc
        await state.engine_loop.set_hold(True)
        if "weights" in tags:  # the staging buffers (re-made by the next update)
            state.weights.drop_buffers()
    return control_response(True, f"released {tags}")


@router.post("/resume_memory_occupation")
async def resume_memory_occupation(request: Request) -> Response:
    state, tags = await _memory_request(request)
    async with state.weights.lock:
        await state.engine_loop.call(lambda e: resume_memory(e, tags, state.host_memory))
        state.released -= set(tags)
        if "kv_cache" not in state.released and not state.paused:
            await state.engine_loop.set_hold(False)
        state.update_gate()
    return control_response(True, f"resumed {tags}")

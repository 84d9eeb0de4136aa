"""Weight and memory routes: updates from disk and over a distributed group, group lifecycle,
memory release/resume for colocated training.

Every update is staged and validated before anything is swapped (`LLMEngine.load_weights`); a
failure answers `success: false` and the previous weights and version keep serving. Tensors are
read (disk) or received (group) off the engine thread, so generation goes on meanwhile; only the
swap itself runs between two engine steps.
"""

from __future__ import annotations

import asyncio
from typing import Any

import torch
from fastapi import APIRouter, Request
from starlette.responses import Response

from tandem.inference.engine import LLMEngine
from tandem.inference.errors import EngineBusyError, WeightUpdateError
from tandem.inference.server.protocol import (
    ApiError,
    ControlError,
    check_fields,
    control_response,
    get_field,
    read_json,
)
from tandem.inference.server.routes import state_of
from tandem.inference.server.state import ServerState
from tandem.inference.weights import stage_weights
from tandem.models.hf_checkpoint import iter_hf_tensors
from tandem.weights import WeightGroup, WeightGroupError, dtype_from_name, init_weight_group

router = APIRouter()
MEMORY_TAGS = ("kv_cache", "weights")


async def _load(state: ServerState, tensors: list[tuple[str, torch.Tensor]], version: str | None,
                abort_all: bool) -> None:
    if abort_all:
        await state.engine_loop.abort(abort_all=True)
    try:
        await state.engine_loop.call(lambda e: e.load_weights(tensors, weight_version=version, strict_dtype=False))
    except WeightUpdateError as exc:
        raise ControlError(f"{exc}; the previous weights keep serving") from exc


def _check_weights_present(state: ServerState) -> None:
    if "weights" in state.released:
        raise ControlError("weights are released; call /resume_memory_occupation first")


@router.post("/update_weights_from_disk")
async def update_weights_from_disk(request: Request) -> Response:
    state = state_of(request)
    state.check_ready()
    body = await read_json(request, allow_empty=False)
    check_fields(body, {"model_path", "load_format", "abort_all_requests", "weight_version", "flush_cache"})
    path = get_field(body, "model_path", str, required=True)
    load_format = get_field(body, "load_format", str, "auto")
    if load_format not in ("auto", "safetensors"):
        raise ApiError(f"load_format {load_format!r} is not supported; use 'auto' or 'safetensors'")
    version = get_field(body, "weight_version", str)
    abort_all = get_field(body, "abort_all_requests", bool, False)
    async with state.update_lock:
        _check_weights_present(state)
        try:
            tensors = await asyncio.to_thread(lambda: list(iter_hf_tensors(path)))
        except Exception as exc:  # missing directory, no safetensors, corrupt file
            raise ControlError(f"cannot read a checkpoint at {path!r}: {exc}; the previous weights keep serving") from exc
        await _load(state, tensors, version, abort_all)
    return control_response(True, f"loaded weights from {path}", weight_version=state.engine.weight_version)


@router.post("/init_weights_update_group")
async def init_weights_update_group(request: Request) -> Response:
    """Join the trainer's weight group as rank `rank_offset`; answers once the group is formed."""
    state = state_of(request)
    state.check_ready()
    body = await read_json(request, allow_empty=False)
    check_fields(body, {"master_address", "master_port", "rank_offset", "world_size", "group_name", "backend"})
    address = get_field(body, "master_address", str, required=True)
    port = get_field(body, "master_port", int, required=True)
    rank = get_field(body, "rank_offset", int, required=True)
    world = get_field(body, "world_size", int, required=True)
    name = get_field(body, "group_name", str, "weight_update_group")
    backend = get_field(body, "backend", str, "nccl" if state.engine.device.type == "cuda" else "gloo")
    if not 1 <= rank < world:
        raise ControlError(f"rank_offset {rank} must be in [1, world_size={world}): rank 0 is the trainer")
    if backend == "nccl" and state.engine.device.type != "cuda":
        raise ControlError("backend 'nccl' needs a CUDA server; this one runs on CPU, use 'gloo'")
    if name in state.groups:
        raise ControlError(f"weight group {name!r} already exists; destroy it first")
    try:
        group = await asyncio.to_thread(init_weight_group, address, port, rank, world, name, backend,
                                        state.args.weight_sync_timeout)
    except WeightGroupError as exc:
        raise ControlError(str(exc)) from exc
    state.groups[name] = group
    return control_response(True, f"joined weight group {name!r} as rank {rank} of {world} ({backend})")


@router.post("/update_weights_from_distributed")
async def update_weights_from_distributed(request: Request) -> Response:
    """Receive `broadcast(src=0)` for each listed tensor, in order, then swap them in atomically.

    Must be a full weight set (names, shapes checked against the model first). When the metadata is
    wrong but well-formed, the tensors are still received (and dropped) so the group stays in step
    with the trainer; then the answer is `success: false`."""
    state = state_of(request)
    state.check_ready()
    body = await read_json(request, allow_empty=False)
    check_fields(body, {"names", "dtypes", "shapes", "group_name", "flush_cache", "abort_all_requests",
                        "weight_version", "load_format"})
    names = get_field(body, "names", list, required=True)
    dtypes = get_field(body, "dtypes", list, required=True)
    shapes = get_field(body, "shapes", list, required=True)
    name = get_field(body, "group_name", str, "weight_update_group")
    version = get_field(body, "weight_version", str)
    abort_all = get_field(body, "abort_all_requests", bool, False)
    get_field(body, "flush_cache", bool, True)  # the prefix cache is always flushed after an update
    if not (len(names) == len(dtypes) == len(shapes)) or not names:
        raise ControlError(f"names, dtypes and shapes must be non-empty lists of one length, got "
                           f"{len(names)}, {len(dtypes)}, {len(shapes)}")
    if not all(isinstance(n, str) for n in names) or not all(
        isinstance(s, list) and all(isinstance(d, int) and d >= 0 for d in s) for s in shapes
    ):
        raise ControlError("names must be strings and shapes lists of non-negative integers")
    group: WeightGroup | None = state.groups.get(name)
    if group is None:
        raise ControlError(f"no weight group {name!r}; call /init_weights_update_group first")
    try:
        torch_dtypes = [dtype_from_name(d) for d in dtypes]
    except WeightGroupError as exc:
        raise ControlError(str(exc)) from exc
    async with state.update_lock:
        problem = None
        try:
            _check_weights_present(state)
            stage_weights(state.engine.model, [(n, torch.empty(s, dtype=d, device="meta"))
                                                for n, s, d in zip(names, shapes, torch_dtypes, strict=True)],
                          strict_dtype=False)
        except (WeightUpdateError, ControlError) as exc:
            problem = str(exc)
        try:
            tensors = await asyncio.to_thread(_receive, group, shapes, torch_dtypes)
        except WeightGroupError as exc:
            raise ControlError(f"{exc}; the previous weights keep serving") from exc
        if problem is not None:
            raise ControlError(f"{problem}; the tensors were received and dropped, the previous weights keep serving")
        device = state.engine.device
        await _load(state, [(n, t.to(device)) for n, t in zip(names, tensors, strict=True)], version, abort_all)
    return control_response(True, f"received and loaded {len(names)} tensors",
                            weight_version=state.engine.weight_version)


def _receive(group: WeightGroup, shapes: list[list[int]], dtypes: list[torch.dtype]) -> list[torch.Tensor]:
    out = []
    for shape, dtype in zip(shapes, dtypes, strict=True):
        out.append(group.broadcast(torch.empty(shape, dtype=dtype, device=group.device), src=0))
    return out


@router.post("/destroy_weights_update_group")
async def destroy_weights_update_group(request: Request) -> Response:
    state = state_of(request)
    state.check_ready()
    body = await read_json(request)
    check_fields(body, {"group_name"})
    name = get_field(body, "group_name", str, "weight_update_group")
    group = state.groups.pop(name, None)
    if group is None:
        raise ControlError(f"no weight group {name!r}")
    await asyncio.to_thread(group.destroy)
    return control_response(True, f"left weight group {name!r}")


# ---------------------------------------------------------------------------------------- memory
def _tags(body: dict[str, Any]) -> list[str]:
    tags = get_field(body, "tags", list, list(MEMORY_TAGS))
    bad = [t for t in tags if t not in MEMORY_TAGS]
    if bad:
        raise ApiError(f"unknown memory tag(s) {bad}; valid tags: {list(MEMORY_TAGS)}")
    return tags


def release_memory(engine: LLMEngine, tags: list[str], host: dict[str, Any]) -> None:
    """Engine thread. kv_cache: free the KV tensor (the prefix cache goes with it). weights: move
    every parameter to host memory (on a CPU device that is where they already are: the copy is
    the parameter itself, so nothing is freed)."""
    if engine.has_unfinished():
        raise EngineBusyError("cannot release memory while requests are in flight; pause generation first")
    runner = engine.runner
    if "kv_cache" in tags and "kv_cache" not in host:
        host["kv_cache"] = (tuple(runner.kv_cache.shape), runner.kv_cache.dtype)
        engine.block_manager.flush()
        runner.kv_cache = torch.empty(0, dtype=runner.kv_cache.dtype, device=runner.device)
        runner.attn.k_caches, runner.attn.v_caches = [], []
    if "weights" in tags and "weights" not in host:
        params = dict(engine.model.named_parameters())
        host["weights"] = {n: p.data.to("cpu") for n, p in params.items()}
        for p in params.values():
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)
    if engine.device.type == "cuda":
        torch.cuda.empty_cache()


def resume_memory(engine: LLMEngine, tags: list[str], host: dict[str, Any]) -> None:
    runner = engine.runner
    if "kv_cache" in tags and "kv_cache" in host:
        shape, dtype = host.pop("kv_cache")
        runner.kv_cache = torch.zeros(shape, dtype=dtype, device=runner.device)
        runner.attn.k_caches = [runner.kv_cache[i, 0] for i in range(shape[0])]
        runner.attn.v_caches = [runner.kv_cache[i, 1] for i in range(shape[0])]
    if "weights" in tags and "weights" in host:
        saved = host.pop("weights")
        for n, p in engine.model.named_parameters():
            p.data = saved[n].to(engine.device)


@router.post("/release_memory_occupation")
async def release_memory_occupation(request: Request) -> Response:
    state = state_of(request)
    state.check_ready()
    body = await read_json(request)
    check_fields(body, {"tags"})
    tags = _tags(body)
    async with state.update_lock:
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
    return control_response(True, f"released {tags}")


@router.post("/resume_memory_occupation")
async def resume_memory_occupation(request: Request) -> Response:
    state = state_of(request)
    state.check_ready()
    body = await read_json(request)
    check_fields(body, {"tags"})
    tags = _tags(body)
    async with state.update_lock:
        await state.engine_loop.call(lambda e: resume_memory(e, tags, state.host_memory))
        state.released -= set(tags)
        if "kv_cache" not in state.released and not state.paused:
            await state.engine_loop.set_hold(False)
        state.update_gate()
    return control_response(True, f"resumed {tags}")

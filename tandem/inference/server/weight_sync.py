"""Weight and memory routes: updates from disk, over a distributed group and from shared memory,
staged multi-bucket updates, group lifecycle, checksums, memory release/resume for colocated
training. The control plane: request parsing, validation, answers; the tensors are handled by
`weight_staging.py` (staged sets, receives, the swap) and `memory.py` (release/resume), fault
injection for tests by `faults.py` (its route is part of this module's `router`).

Every update is staged and validated before anything is swapped (`weight_staging.load_tensors`:
names, shapes, finite values); a failure answers `success: false` and the previous weights and
version keep serving. Tensors are
read (disk), received (group) or mapped (shared memory) off the engine thread, so generation goes
on meanwhile; only the swap itself runs between two engine steps.

Staged updates (two-phase, for trainers that send a model in several buckets): a bucket sent with
`"commit": false` is validated (known names, shapes, no tensor twice) and kept; `bucket_index` 0
starts a new staged set (dropping any earlier one), k > 0 must follow bucket k - 1.
`/commit_staged_weights` checks that the set is complete and swaps it in with its version;
`/discard_staged_weights` drops it. Any failed bucket drops the whole set. So a fleet either
commits everything everywhere or keeps the previous weights.

Flat buckets (`offsets` + `nbytes` on /update_weights_from_distributed): the bucket arrives as ONE
broadcast of a uint8 buffer and its tensors are views at the announced offsets. Staged buckets are
received into persistent staging buffers, one per bucket index, never into fresh memory once warm;
the commit adopts them (ping-pong, see `weight_staging.py`), so a server taking distributed
updates holds two copies of the weights. `/release_memory_occupation` with the `weights` tag drops
the staging buffers (and what is staged).
"""

from __future__ import annotations

import asyncio
import math
from typing import Any

import torch
from fastapi import APIRouter, Request
from starlette.responses import Response

from tandem.inference.errors import EngineBusyError, WeightUpdateError
from tandem.inference.server import faults
from tandem.inference.server.faults import fault_point
from tandem.inference.server.memory import MEMORY_TAGS, release_memory, resume_memory
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
from tandem.inference.server.weight_paths import check_weights_path
from tandem.inference.server.weight_staging import (
    Staging,
    check_bucket,
    check_weights_present,
    discard,
    load_tensors,
    receive,
    receive_buffer,
    receive_flat,
    staging_for,
    swap_in,
)
from tandem.inference.weights import stage_weights, weight_checksums
from tandem.models.hf_checkpoint import iter_hf_tensors
from tandem.weights import WeightGroup, WeightGroupError, dtype_from_name, init_weight_group
from tandem.weights.shm import ShmError, map_segment, open_cuda_ipc, tensor_views

router = APIRouter()
router.include_router(faults.router)  # POST /_fault (only with TANDEM_FAULT_INJECTION=1)
STAGE_FIELDS = {"commit", "bucket_index"}


async def _finish(state: ServerState, staging: Staging, named: list[tuple[str, torch.Tensor]], commit: bool,
                  version: str | None, abort_all: bool, what: str, flat_index: int | None = None,
                  in_place: bool = False) -> Response:
    if staging.discarded:
        raise ControlError("the staged update was discarded while this bucket arrived; the previous weights "
                           "keep serving")
    staging.add(named, flat_index, in_place)
    if not commit:
        return control_response(True, f"staged {what} (bucket {staging.buckets - 1}, {len(staging.names)} tensors "
                                      "so far)")
    return await _commit(state, staging, version, abort_all, what)


async def _commit(state: ServerState, staging: Staging, version: str | None, abort_all: bool,
                  what: str) -> Response:
    count = await swap_in(state, staging, version, abort_all)
    return control_response(True, f"loaded {what} ({count} tensors)", weight_version=state.engine.weight_version)


def _stage_args(body: dict[str, Any]) -> tuple[bool, int | None, str | None, bool]:
    commit = get_field(body, "commit", bool, True)
    bucket_index = get_field(body, "bucket_index", int)
    if bucket_index is not None and bucket_index < 0:
        raise ApiError("field 'bucket_index' must be >= 0")
    return commit, bucket_index, get_field(body, "weight_version", str), get_field(body, "abort_all_requests", bool, False)


def _tensor_meta(body: dict[str, Any]) -> tuple[list[str], list[torch.dtype], list[list[int]]]:
    names = get_field(body, "names", list, required=True)
    dtypes = get_field(body, "dtypes", list, required=True)
    shapes = get_field(body, "shapes", list, required=True)
    if not (len(names) == len(dtypes) == len(shapes)) or not names:
        raise ControlError(f"names, dtypes and shapes must be non-empty lists of one length, got "
                           f"{len(names)}, {len(dtypes)}, {len(shapes)}")
    if not all(isinstance(n, str) for n in names) or not all(
        isinstance(s, list) and all(isinstance(d, int) and d >= 0 for d in s) for s in shapes
    ):
        raise ControlError("names must be strings and shapes lists of non-negative integers")
    try:
        return names, [dtype_from_name(d) for d in dtypes], shapes
    except WeightGroupError as exc:
        raise ControlError(str(exc)) from exc


def _meta_tensors(names, shapes, dtypes) -> list[tuple[str, torch.Tensor]]:
    return [(n, torch.empty(s, dtype=d, device="meta")) for n, s, d in zip(names, shapes, dtypes, strict=True)]


# -------------------------------------------------------------------------------------- routes
@router.post("/update_weights_from_disk")
async def update_weights_from_disk(request: Request) -> Response:
    state = state_of(request)
    await fault_point(request, "update_weights_from_disk")
    state.check_ready()
    body = await read_json(request, allow_empty=False)
    check_fields(body, {"model_path", "load_format", "abort_all_requests", "weight_version", "flush_cache", "commit"})
    path = get_field(body, "model_path", str, required=True)
    check_weights_path(path, state.weight_dirs)  # 403 before anything looks at the path
    load_format = get_field(body, "load_format", str, "auto")
    if load_format not in ("auto", "safetensors"):
        raise ApiError(f"load_format {load_format!r} is not supported; use 'auto' or 'safetensors'")
    commit, _, version, abort_all = _stage_args(body)
    async with state.update_lock:
        check_weights_present(state)
        try:
            tensors = await asyncio.to_thread(lambda: list(iter_hf_tensors(path)))
        except Exception as exc:  # missing directory, no safetensors, corrupt file
            raise ControlError(f"cannot read a checkpoint at {path!r}: {exc}; the previous weights keep serving") from exc
        if commit:
            await load_tensors(state, tensors, version, abort_all)
            return control_response(True, f"loaded weights from {path}", weight_version=state.engine.weight_version)
        discard(state)
        try:  # a checkpoint is a full set: check it all now, so the commit cannot fail on it
            await asyncio.to_thread(stage_weights, state.engine.model, tensors, strict_dtype=False)
        except WeightUpdateError as exc:
            raise ControlError(f"{exc}; the previous weights keep serving") from exc
        staging = Staging(f"disk:{path}")
        staging.add(tensors)
        state.staged = staging
    return control_response(True, f"staged weights from {path} ({len(tensors)} tensors)")


@router.post("/init_weights_update_group")
async def init_weights_update_group(request: Request) -> Response:
    """Join the trainer's weight group as rank `rank_offset`; answers once the group is formed.
    `timeout_s` (optional, tandem extension) bounds forming the group and each receive."""
    state = state_of(request)
    await fault_point(request, "init_weights_update_group")
    state.check_ready()
    body = await read_json(request, allow_empty=False)
    check_fields(body, {"master_address", "master_port", "rank_offset", "world_size", "group_name", "backend",
                        "timeout_s"})
    address = get_field(body, "master_address", str, required=True)
    port = get_field(body, "master_port", int, required=True)
    rank = get_field(body, "rank_offset", int, required=True)
    world = get_field(body, "world_size", int, required=True)
    name = get_field(body, "group_name", str, "weight_update_group")
    backend = get_field(body, "backend", str, "nccl" if state.engine.device.type == "cuda" else "gloo")
    timeout = float(get_field(body, "timeout_s", float, state.args.weight_sync_timeout))
    if not 1 <= rank < world:
        raise ControlError(f"rank_offset {rank} must be in [1, world_size={world}): rank 0 is the trainer")
    if backend == "nccl" and state.engine.device.type != "cuda":
        raise ControlError("backend 'nccl' needs a CUDA server; this one runs on CPU, use 'gloo'")
    if not 0 < timeout <= 86400:
        raise ControlError(f"timeout_s must be in (0, 86400], got {timeout}")
    if name in state.groups:
        raise ControlError(f"weight group {name!r} already exists; destroy it first")
    try:
        group = await asyncio.to_thread(init_weight_group, address, port, rank, world, name, backend, timeout)
    except WeightGroupError as exc:
        raise ControlError(str(exc)) from exc
    if name in state.groups:  # a concurrent join of the same name won
        await asyncio.to_thread(group.destroy)
        raise ControlError(f"weight group {name!r} already exists; destroy it first")
    state.groups[name] = group
    return control_response(True, f"joined weight group {name!r} as rank {rank} of {world} ({backend})")


@router.post("/update_weights_from_distributed")
async def update_weights_from_distributed(request: Request) -> Response:
    """Receive `broadcast(src=0)` for each listed tensor, in order; then swap them in atomically, or
    (`"commit": false`) stage them as one bucket of a larger update.

    Without staging it must be a full weight set (names, shapes checked against the model first).
    When the metadata is wrong but well-formed, the tensors are still received (and dropped) so the
    group stays in step with the trainer; then the answer is `success: false`."""
    state = state_of(request)
    fault = await fault_point(request, "update_weights_from_distributed")
    state.check_ready()
    body = await read_json(request, allow_empty=False)
    check_fields(body, {"names", "dtypes", "shapes", "group_name", "flush_cache", "abort_all_requests",
                        "weight_version", "load_format", "offsets", "nbytes"} | STAGE_FIELDS)
    names, torch_dtypes, shapes = _tensor_meta(body)
    flat = _flat_layout(body, len(names))
    name = get_field(body, "group_name", str, "weight_update_group")
    commit, bucket_index, version, abort_all = _stage_args(body)
    get_field(body, "flush_cache", bool, True)  # the prefix cache is always flushed after an update
    group: WeightGroup | None = state.groups.get(name)
    if group is None:
        raise ControlError(f"no weight group {name!r}; call /init_weights_update_group first")
    async with state.update_lock:
        problem = None
        staging = None
        try:
            staging = staging_for(state, f"group {name!r}", commit, bucket_index)
            check_bucket(state, staging, _meta_tensors(names, shapes, torch_dtypes))
            if flat is not None:  # the layout must fit the buffer (checked on a meta tensor)
                tensor_views(torch.empty(flat[1], dtype=torch.uint8, device="meta"), flat[0], shapes, torch_dtypes)
        except (ControlError, ShmError) as exc:
            problem = str(exc)
        kill_after = fault.after_tensors if fault is not None else None
        reuse = None
        try:
            if flat is None:
                tensors = await asyncio.to_thread(receive, group, shapes, torch_dtypes, kill_after)
            else:
                # Persistent buffer only for a well-formed staged bucket: bucket k of a set is the
                # only user of buffer k, and bucket 0 drops the previous set before it lands.
                reuse = bucket_index if problem is None and bucket_index is not None else None
                buf = receive_buffer(state, reuse, flat[1], group.device)
                tensors = await asyncio.to_thread(receive_flat, group, buf, flat[0], shapes, torch_dtypes,
                                                  kill_after)
        except WeightGroupError as exc:
            discard(state)
            raise ControlError(f"{exc}; the previous weights keep serving") from exc
        if problem is not None:
            discard(state)
            raise ControlError(f"{problem}; the tensors were received and dropped, the previous weights keep serving")
        if len(tensors) != len(names):
            raise ControlError("the flat bucket's layout does not fit its buffer")
        return await _finish(state, staging, list(zip(names, tensors, strict=True)), commit, version, abort_all,
                             f"{len(names)} tensors from group {name!r}",
                             flat_index=reuse)


def _flat_layout(body: dict[str, Any], count: int) -> tuple[list[int], int] | None:
    offsets = get_field(body, "offsets", list)
    nbytes = get_field(body, "nbytes", int)
    if offsets is None and nbytes is None:
        return None
    if offsets is None or nbytes is None or nbytes <= 0 or len(offsets) != count or not all(
            isinstance(o, int) and not isinstance(o, bool) for o in offsets):
        raise ControlError("a flat bucket needs 'offsets' (one integer per tensor) and a positive 'nbytes'")
    return offsets, nbytes


@router.post("/update_weights_from_shm")
async def update_weights_from_shm(request: Request) -> Response:
    """One bucket from a shared-memory segment written by a trainer on this host (tandem
    extension): `segment` (a /dev/shm name `tandem-w-...`) or `cuda_ipc` (a CUDA IPC handle),
    `nbytes` (its size), and per tensor `names`, `dtypes`, `shapes`, `offsets` (in the segment;
    only the bytes they span are mapped, so one segment may carry several buckets); staged like
    the other routes. `zero_copy: true` (segments only): the trainer will not write the segment
    while this server serves from it, so the bucket is mapped copy-on-write and, at commit, the
    parameters become views of it; otherwise it is copied out while the request is answered."""
    state = state_of(request)
    await fault_point(request, "update_weights_from_shm")
    state.check_ready()
    body = await read_json(request, allow_empty=False)
    check_fields(body, {"names", "dtypes", "shapes", "offsets", "segment", "cuda_ipc", "nbytes", "flush_cache",
                        "abort_all_requests", "weight_version", "zero_copy"} | STAGE_FIELDS)
    names, torch_dtypes, shapes = _tensor_meta(body)
    offsets = get_field(body, "offsets", list, required=True)
    nbytes = get_field(body, "nbytes", int, required=True)
    segment = get_field(body, "segment", str)
    handle = get_field(body, "cuda_ipc", str)
    zero_copy = get_field(body, "zero_copy", bool, False) and segment is not None
    commit, bucket_index, version, abort_all = _stage_args(body)
    if len(offsets) != len(names) or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets):
        raise ControlError("offsets must be a list of integers, one per tensor")
    if (segment is None) == (handle is None):
        raise ControlError("send exactly one of 'segment' (host shared memory) and 'cuda_ipc'")
    if handle is not None and state.engine.device.type != "cuda":
        raise ControlError("'cuda_ipc' needs a CUDA server; this one runs on CPU, use 'segment'")
    async with state.update_lock:
        try:
            staging = staging_for(state, "shared memory", commit, bucket_index)
            check_bucket(state, staging, _meta_tensors(names, shapes, torch_dtypes))

            # A zero-copy bucket (CPU server) is served from where it is: its copy-on-write views
            # are staged and the commit makes them the parameters. Any other staged segment bucket
            # is copied at once into staging buffer k (as a distributed flat bucket is received
            # into it) and unmapped: the copy overlaps the trainer writing the next bucket, the
            # commit adopts the buffers (ping-pong), and no mapping outlives the request. CUDA IPC
            # buckets arrive as a server-owned copy already (copied at commit).
            in_place = zero_copy and state.engine.device.type == "cpu"
            reuse = bucket_index if segment is not None and bucket_index is not None and not in_place else None
            # Only the window of the segment this bucket's tensors occupy is mapped (a segment may
            # hold the whole update, announced in several buckets).
            start, end = _window(offsets, shapes, torch_dtypes, nbytes)

            def read() -> list[torch.Tensor]:
                if segment is None:
                    return tensor_views(open_cuda_ipc(handle, state.engine.device), offsets, shapes, torch_dtypes)
                mapped, base = map_segment(segment, nbytes, private=in_place, start=start, end=end)
                local = [o - base for o in offsets]
                if in_place or reuse is None:  # served in place, or a one-shot update copied at commit
                    return tensor_views(mapped, local, shapes, torch_dtypes)
                tensor_views(mapped, local, shapes, torch_dtypes)  # the layout fits the window
                staged_buf = receive_buffer(state, reuse, mapped.numel(), state.engine.device)
                staged_buf.copy_(mapped)
                del mapped  # unmapped here
                return tensor_views(staged_buf, local, shapes, torch_dtypes)

            tensors = await asyncio.to_thread(read)
        except (ControlError, ShmError) as exc:
            discard(state)
            raise ControlError(f"{exc}; the previous weights keep serving") from exc
        return await _finish(state, staging, list(zip(names, tensors, strict=True)), commit, version, abort_all,
                             f"{len(names)} tensors from shared memory", flat_index=reuse, in_place=in_place)


def _window(offsets: list[int], shapes: list[list[int]], dtypes: list[torch.dtype], nbytes: int) -> tuple[int, int]:
    """Bytes [start, end) of a segment of `nbytes` that a bucket's tensors occupy."""
    if not offsets:
        raise ControlError("a shared-memory bucket needs at least one tensor")
    ends = [o + math.prod(s) * d.itemsize for o, s, d in zip(offsets, shapes, dtypes, strict=True)]
    start, end = min(offsets), max(ends)
    if start < 0 or end > nbytes:
        raise ControlError(f"tensors span bytes [{start}, {end}) but the segment has nbytes={nbytes}; "
                           "offsets and nbytes must describe the segment")
    return start, max(end, start + 1)


@router.post("/commit_staged_weights")
async def commit_staged_weights(request: Request) -> Response:
    """Swap in the staged update (it must be a full set) and set `weight_version` (tandem extension)."""
    state = state_of(request)
    await fault_point(request, "commit_staged_weights")
    state.check_ready()
    body = await read_json(request)
    check_fields(body, {"weight_version", "abort_all_requests", "flush_cache"})
    version = get_field(body, "weight_version", str)
    abort_all = get_field(body, "abort_all_requests", bool, False)
    async with state.update_lock:
        staging: Staging | None = state.staged
        if staging is None:
            raise ControlError("no staged weight update to commit")
        check_weights_present(state)
        return await _commit(state, staging, version, abort_all, f"the staged update from {staging.source}")


@router.post("/discard_staged_weights")
async def discard_staged_weights(request: Request) -> Response:
    """Drop the staged update, if any (tandem extension). Does not wait for a bucket in flight: that
    bucket is refused when it arrives."""
    state = state_of(request)
    await fault_point(request, "discard_staged_weights")
    state.check_ready()
    check_fields(await read_json(request), set())
    had = state.staged is not None
    discard(state)
    return control_response(True, "discarded the staged update" if had else "nothing was staged")


@router.post("/get_weights_checksum")
async def get_weights_checksum(request: Request) -> Response:
    """`{"names"?: [...]}` -> `{"checksums": {hf_name: sha256 hex}, "dtype"}` of the served weights
    (all parameters by default; tandem extension, for verifying an update)."""
    state = state_of(request)
    state.check_ready()
    body = await read_json(request)
    check_fields(body, {"names"})
    names = get_field(body, "names", list)
    async with state.update_lock:
        check_weights_present(state)
        try:
            sums = await asyncio.to_thread(weight_checksums, state.engine.model, names)
        except WeightUpdateError as exc:
            raise ControlError(str(exc)) from exc
    dtype = str(state.engine.dtype).removeprefix("torch.")
    return control_response(True, f"{len(sums)} checksums", checksums=sums, dtype=dtype,
                            weight_version=state.engine.weight_version)


@router.post("/destroy_weights_update_group")
async def destroy_weights_update_group(request: Request) -> Response:
    state = state_of(request)
    await fault_point(request, "destroy_weights_update_group")
    state.check_ready()
    body = await read_json(request)
    check_fields(body, {"group_name"})
    name = get_field(body, "group_name", str, "weight_update_group")
    group = state.groups.pop(name, None)
    if group is None:
        raise ControlError(f"no weight group {name!r}")
    if state.staged is not None and state.staged.source == f"group {name!r}":
        discard(state)
    await asyncio.to_thread(group.destroy)
    return control_response(True, f"left weight group {name!r}")


# ---------------------------------------------------------------------------------------- memory
def _tags(body: dict[str, Any]) -> list[str]:
    tags = get_field(body, "tags", list, list(MEMORY_TAGS))
    bad = [t for t in tags if t not in MEMORY_TAGS]
    if bad:
        raise ApiError(f"unknown memory tag(s) {bad}; valid tags: {list(MEMORY_TAGS)}")
    return tags


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
        if "weights" in tags:  # the staging buffers of flat buckets (re-made by the next update)
            discard(state)
            state.weight_buffers, state.live_buffers = {}, {}
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

"""Weight routes: updates from disk, over a distributed group and from shared memory, staged
multi-bucket updates, group lifecycle, checksums (docs/weight-sync.md has the protocol). Each
route checks its body into a typed request (`requests.py`), hands it to the server's
`WeightReceiver` (`receiver.py`) and answers `{"success", "message", ...}`. Only when the server
runs with fault injection (tests; `tandem.inference.server.faults`) is `state.faults` set and
consulted first.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from starlette.responses import Response

from tandem.inference.server.http_api import check_fields, control_response, get_field, get_version, read_json
from tandem.inference.server.routes import state_of
from tandem.inference.server.state import ServerState
from tandem.inference.server.weights.receiver import Applied
from tandem.inference.server.weights.requests import (
    DEFAULT_GROUP,
    parse_disk,
    parse_distributed,
    parse_join,
    parse_shared,
)

router = APIRouter()


async def _ready(request: Request, route: str) -> ServerState:
    """The server's state for weight route `route`, once its injected fault (tests only) has had
    its turn and the server is ready."""
    state = state_of(request)
    if state.faults is not None:
        await state.faults.hit(route)
    state.check_ready()
    return state


def _answer(applied: Applied) -> Response:
    if applied.weight_version is None:
        return control_response(True, applied.message)
    return control_response(True, applied.message, weight_version=str(applied.weight_version))


@router.post("/update_weights_from_disk")
async def update_weights_from_disk(request: Request) -> Response:
    """Load an HF checkpoint directory (inside `--model` or a `--weights-dir`, else 403); with
    `"commit": false` it is checked and staged for `/commit_staged_weights`."""
    state = await _ready(request, "update_weights_from_disk")
    update = parse_disk(await read_json(request, allow_empty=False), state.weight_dirs)
    return _answer(await state.weights.load_from_disk(update))


@router.post("/init_weights_update_group")
async def init_weights_update_group(request: Request) -> Response:
    """Join the trainer's weight group as rank `rank_offset`; answers once the group is formed.
    `timeout_s` (optional, tandem extension) bounds forming the group and each receive."""
    state = await _ready(request, "init_weights_update_group")
    join = parse_join(await read_json(request, allow_empty=False), state.engine.device.type,
                      state.args.weight_sync_timeout)
    return control_response(True, await state.weights.join(join))


@router.post("/update_weights_from_distributed")
async def update_weights_from_distributed(request: Request) -> Response:
    """Receive `broadcast(src=0)` for each listed tensor, in order (or, with `offsets` + `nbytes`,
    one flat uint8 broadcast holding them all); then swap them in atomically, or (`"commit":
    false`) stage them as one bucket of a larger update. Without staging any subset of the model
    is applied at once (SGLang's semantics: AReaL sends partial buckets); a staged set must be
    complete at commit. When the metadata is wrong but well-formed, the tensors are still received (and dropped)
    so the group stays in step with the trainer; then the answer is `success: false`."""
    state = state_of(request)
    fault = await state.faults.hit("update_weights_from_distributed") if state.faults is not None else None
    state.check_ready()
    bucket = parse_distributed(await read_json(request, allow_empty=False))
    kill_after = fault.after_tensors if fault is not None else None
    return _answer(await state.weights.receive_distributed(bucket, kill_after))


@router.post("/update_weights_from_shm")
async def update_weights_from_shm(request: Request) -> Response:
    """One bucket from a shared-memory segment written by a trainer on this host (tandem
    extension): `segment` (a /dev/shm name `tandem-w-...`) or `cuda_ipc` (a CUDA IPC handle),
    `nbytes` (its size), and per tensor `names`, `dtypes`, `shapes`, `offsets` (in the segment;
    only the bytes they span are mapped, so one segment may carry several buckets); staged like
    the other routes. `zero_copy: true` (segments only): the trainer will not write the segment
    while this server serves from it, so the bucket is mapped copy-on-write and, at commit, the
    parameters become views of it; otherwise it is copied out while the request is answered."""
    state = await _ready(request, "update_weights_from_shm")
    bucket = parse_shared(await read_json(request, allow_empty=False), state.engine.device.type)
    return _answer(await state.weights.take_shared(bucket))


@router.post("/commit_staged_weights")
async def commit_staged_weights(request: Request) -> Response:
    """Swap in the staged update (it must be a full set) and set `weight_version` (tandem extension)."""
    state = await _ready(request, "commit_staged_weights")
    body = await read_json(request)
    check_fields(body, {"weight_version", "abort_all_requests", "flush_cache"})
    version = get_version(body, "weight_version")
    abort_all = get_field(body, "abort_all_requests", bool, False)
    return _answer(await state.weights.commit(version, abort_all))


@router.post("/discard_staged_weights")
async def discard_staged_weights(request: Request) -> Response:
    """Drop the staged update, if any (tandem extension). Does not wait for a bucket in flight: that
    bucket is refused when it arrives."""
    state = await _ready(request, "discard_staged_weights")
    check_fields(await read_json(request), set())
    had = state.weights.discard()
    return control_response(True, "discarded the staged update" if had else "nothing was staged")


@router.post("/get_weights_checksum")
async def get_weights_checksum(request: Request) -> Response:
    """`{"names"?: [...]}` -> `{"checksums": {hf_name: sha256 hex}, "dtype"}` of the served weights
    (all parameters by default; tandem extension, for verifying an update)."""
    state = state_of(request)
    state.check_ready()
    body = await read_json(request)
    check_fields(body, {"names"})
    sums = await state.weights.checksums(get_field(body, "names", list))
    dtype = str(state.engine.dtype).removeprefix("torch.")
    return control_response(True, f"{len(sums)} checksums", checksums=sums, dtype=dtype,
                            weight_version=str(state.engine.weight_version))


@router.post("/destroy_weights_update_group")
async def destroy_weights_update_group(request: Request) -> Response:
    state = await _ready(request, "destroy_weights_update_group")
    body = await read_json(request)
    check_fields(body, {"group_name"})
    name = get_field(body, "group_name", str, DEFAULT_GROUP)
    await state.weights.leave(name)
    return control_response(True, f"left weight group {name!r}")

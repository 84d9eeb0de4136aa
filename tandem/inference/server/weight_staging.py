"""Staged weight updates on the server, the data plane behind the weight routes (`weight_sync.py`):
the buckets of an update received so far (`Staging`), their validation against the model, the
persistent receive buffers of flat buckets, the receives themselves (broadcasts over the weight
group) and the swap into the engine.

Bucket 0 (or a one-shot update) starts a new staged set, dropping any earlier one; bucket k > 0
must follow bucket k - 1. Flat buckets are received into persistent staging buffers, one per
bucket index (`state.weight_buffers`). Ping-pong: when a whole staged set came in that way (or as
zero-copy shared-memory segments, which the trainer writes in turn) in the serving dtype, the
swap rebinds every parameter to its view (no copy) and the buffers that backed the parameters
until then (`state.live_buffers`) become the next update's staging buffers; otherwise the swap
copies into the parameters in place. A failed or discarded update leaves the live weights
untouched.
"""

from __future__ import annotations

import asyncio
import os
import signal
from dataclasses import dataclass, field

import torch

from tandem.inference.errors import WeightUpdateError
from tandem.inference.server.protocol import ControlError
from tandem.inference.server.state import ServerState
from tandem.inference.weights import ADOPTED, mark_adoptable, stage_weights
from tandem.weights import WeightGroup
from tandem.weights.shm import ShmError, tensor_views


@dataclass
class Staging:
    """Buckets of one update received so far (tensors stay referenced until commit/discard)."""

    source: str
    tensors: list[tuple[str, torch.Tensor]] = field(default_factory=list)
    names: set[str] = field(default_factory=set)
    buckets: int = 0
    discarded: bool = False
    flat: set[int] = field(default_factory=set)  # buckets received into staging buffer k
    adoptable: bool = True  # every bucket so far: the commit may keep the tensors as parameters
    shared: bool = False  # some bucket lives in a zero-copy shared-memory segment

    def add(self, named: list[tuple[str, torch.Tensor]], flat_index: int | None = None,
            in_place: bool = False) -> None:
        """One bucket; `flat_index`: it sits in staging buffer k; `in_place`: it sits in memory the
        parameters may keep (a zero-copy shared-memory segment)."""
        self.tensors.extend(named)
        self.names.update(n for n, _ in named)
        self.buckets += 1
        if flat_index is not None:
            self.flat.add(flat_index)
        elif in_place:
            self.shared = True
        else:
            self.adoptable = False


def discard(state: ServerState) -> None:
    if state.staged is not None:
        state.staged.discarded = True
    state.staged = None


def staging_for(state: ServerState, source: str, commit: bool, bucket_index: int | None) -> Staging:
    """The staged set this bucket belongs to (a fresh one for bucket 0 or a one-shot update)."""
    current: Staging | None = state.staged
    if bucket_index == 0 or (current is None and bucket_index is None):
        discard(state)
        current = Staging(source)
        if not commit or bucket_index is not None:
            state.staged = current
        return current
    if current is None:
        raise ControlError(f"bucket {bucket_index} arrived but nothing is staged (bucket 0 missing or discarded)")
    if current.source != source:
        raise ControlError(f"a staged update from {current.source} is pending; commit or discard it first")
    if bucket_index is not None and bucket_index != current.buckets:
        discard(state)
        raise ControlError(f"bucket {bucket_index} arrived after {current.buckets} staged bucket(s); "
                           "the staged update was discarded")
    return current


def check_bucket(state: ServerState, staging: Staging, named: list[tuple[str, torch.Tensor]]) -> None:
    """Names/shapes/dtypes of one bucket (meta tensors are fine) against the model and the set."""
    check_weights_present(state)
    twice = sorted({n for n, _ in named} & staging.names)
    if twice or len({n for n, _ in named}) != len(named):
        raise ControlError(f"weight update sends tensor(s) twice: {twice or 'within one bucket'}")
    try:
        stage_weights(state.engine.model, named, strict_dtype=False, partial=True)
    except WeightUpdateError as exc:
        raise ControlError(str(exc)) from exc


async def swap_in(state: ServerState, staging: Staging, version: str | None, abort_all: bool) -> int:
    """Swap the staged set into the engine (between two engine steps) under `version`; -> the
    number of tensors. The set is consumed either way: late buckets of it are refused."""
    if state.staged is staging:
        state.staged = None
    staging.discarded = True  # consumed: late buckets of this set are refused
    device = state.engine.device
    tensors = [(n, t if t.device == device else t.to(device)) for n, t in staging.tensors]
    staging.tensors = []
    if staging.adoptable and staging.buckets:
        for _, t in tensors:
            mark_adoptable(t, shared=staging.shared)
    await load_tensors(state, tensors, version, abort_all)
    if any(getattr(t, ADOPTED, False) for _, t in tensors):
        # Ping-pong: the parameters now live in this set's staging buffers (or shared-memory
        # segments); the buffers that held them until now are free (every parameter was rebound)
        # and become the next staging set.
        staging_buffers: dict[int, torch.Tensor] = getattr(state, "weight_buffers", None) or {}
        live = {k: staging_buffers.pop(k) for k in staging.flat if k in staging_buffers}
        state.weight_buffers = {**staging_buffers, **(getattr(state, "live_buffers", None) or {})}
        state.live_buffers = live
    return len(tensors)


async def load_tensors(state: ServerState, tensors: list[tuple[str, torch.Tensor]], version: str | None,
                abort_all: bool) -> None:
    """Validate the full set (`stage_weights`: names, shapes, finite values) on a worker thread,
    so generation goes on meanwhile and a refused set aborts nothing; then abort in-flight requests
    if asked and swap it in between two engine steps. Refused: ControlError, nothing changed."""
    try:
        staged = await asyncio.to_thread(stage_weights, state.engine.model, tensors, strict_dtype=False)
    except WeightUpdateError as exc:
        raise ControlError(f"{exc}; the previous weights keep serving") from exc
    if abort_all:
        await state.engine_loop.abort(abort_all=True)
    await state.engine_loop.call(lambda e: e.swap_staged(staged, weight_version=version))


def check_weights_present(state: ServerState) -> None:
    if "weights" in state.released:
        raise ControlError("weights are released; call /resume_memory_occupation first")


def receive(group: WeightGroup, shapes: list[list[int]], dtypes: list[torch.dtype],
             kill_after: int | None = None) -> list[torch.Tensor]:
    out = []
    for shape, dtype in zip(shapes, dtypes, strict=True):
        if kill_after is not None and len(out) >= kill_after:
            os.kill(os.getpid(), signal.SIGKILL)  # injected fault: die mid-broadcast
        out.append(group.broadcast(torch.empty(shape, dtype=dtype, device=group.device), src=0))
    return out


def receive_buffer(state: ServerState, index: int | None, nbytes: int, device: torch.device) -> torch.Tensor:
    """A uint8 buffer of `nbytes` for one flat bucket: the persistent one of staged bucket `index`
    (grown when too small), or a fresh one when `index` is None."""
    if index is None:
        return torch.empty(nbytes, dtype=torch.uint8, device=device)
    buffers: dict[int, torch.Tensor] = getattr(state, "weight_buffers", None) or {}
    state.weight_buffers = buffers
    buf = buffers.get(index)
    if buf is None or buf.numel() < nbytes or buf.device != device:
        buffers[index] = buf = torch.empty(nbytes, dtype=torch.uint8, device=device)
    return buf[:nbytes]


def receive_flat(group: WeightGroup, buf: torch.Tensor, offsets: list[int], shapes: list[list[int]],
                  dtypes: list[torch.dtype], kill_after: int | None = None) -> list[torch.Tensor]:
    if kill_after is not None:
        os.kill(os.getpid(), signal.SIGKILL)  # injected fault: die as the bucket's one broadcast starts
    group.broadcast(buf, src=0)
    try:
        return tensor_views(buf, offsets, shapes, dtypes)
    except ShmError:  # a bad layout was reported before receiving; the bytes are dropped
        return []


"""Rank 0's data plane of a weight update: which tensors form each bucket, and how a bucket becomes
bytes to send. No fleet calls here (see `update.py` for the orchestration).

- `export_buckets`: the buckets of `(hf_name, tensor)` to send. At trainer world size 1 with plain
  parameters, the parameters themselves, uncast (`plan_buckets` gives the boundaries); otherwise
  the engine's own `export_weights` (gathers, a collective every rank joins).
- `SendBuffers.pack`: one bucket cast straight into one of two flat uint8 send buffers
  (distributed; kept for the updater's life, so no bucket allocates), a /dev/shm segment, or a CUDA
  IPC buffer (shm), at 64-byte-aligned offsets: a `Packed` bucket. `SendBuffers.reserve`: the same
  place before the bucket exists, for an FSDP export to gather into (no pack copy).
- `broadcast_all`: the trainer's side of one bucket's broadcasts (the flat buffer, or one per tensor).
"""

from __future__ import annotations

import dataclasses
import inspect
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from tandem.weights.group import WeightGroup, dtype_from_name
from tandem.weights.meta import ParamSpec, ShmBucket, WeightUpdateMeta
from tandem.weights.shm import ALIGN, ShmWriter, cuda_ipc_handle, layout, tensor_views

if TYPE_CHECKING:
    from tandem.train.weight_export import Alloc

Bucket = list[tuple[str, torch.Tensor]]


@dataclass
class Packed:
    """One bucket, packed: its tensors' names/specs, their offsets in a flat buffer (distributed)
    or an shm segment / CUDA IPC buffer (shm), and views of the packed tensors (for hashing)."""

    names: list[str]
    specs: tuple[ParamSpec, ...]
    offsets: list[int]
    nbytes: int
    views: list[torch.Tensor]
    flat: torch.Tensor | None = None
    shm: ShmBucket | None = None

    def tensor_views(self) -> list[torch.Tensor]:
        """Each tensor of a flat bucket as a view of the buffer (the per-tensor broadcasts)."""
        return tensor_views(self.flat, self.offsets, [s.shape for s in self.specs],
                            [dtype_from_name(s.dtype) for s in self.specs])


class FlatBuffers:
    """Flat uint8 send buffers, one per slot (two when pipelined), allocated once and grown only
    when a bucket needs more: every later update casts into warm memory."""

    def __init__(self) -> None:
        self.slots: dict[int, torch.Tensor] = {}

    def get(self, slot: int, nbytes: int, device: torch.device) -> torch.Tensor:
        buf = self.slots.get(slot)
        if buf is None or buf.numel() < nbytes or buf.device != device:
            buf = None
            self.slots.pop(slot, None)  # free the old one before allocating the larger one
            buf = self.slots[slot] = torch.empty(nbytes, dtype=torch.uint8, device=device)
        return buf[:nbytes]

    def clear(self) -> None:
        self.slots.clear()


class SendBuffers:
    """Where rank 0 packs buckets: the flat send buffers (distributed), the shm writers' segments
    and the CUDA IPC buffers that must stay alive until the update ends (shm).

    Segments come in two sets written in turn (ping-pong), so servers can serve straight from the
    set of the last committed update (`ShmBucket.zero_copy`) while the next one is written into
    the other: `rewind_shm` picks the set that is not live, `shm_committed` marks it live, and
    after a failure `release_shm` drops both (a server may still serve from either; it keeps its
    mapping of the unlinked file and the next update writes fresh segments)."""

    def __init__(self) -> None:
        self.flat = FlatBuffers()
        self.shm_sets: list[ShmWriter | None] = [None, None]
        self.shm_live: int | None = None  # the set the servers serve from
        self.shm_current = 0  # the set this update writes
        self.keep: list[torch.Tensor] = []  # CUDA IPC buffers, alive until the update ends

    @property
    def shm(self) -> ShmWriter | None:
        return self.shm_sets[self.shm_current]

    def rewind_shm(self, expected: int | None = None) -> None:
        """Before an shm update of about `expected` bytes: write the set that is not live,
        reusing its segments (the other set's last update tells its size when `expected` does not)."""
        self.shm_current = 0 if self.shm_live is None else 1 - self.shm_live
        if self.shm_sets[self.shm_current] is None:
            self.shm_sets[self.shm_current] = ShmWriter()
        other = self.shm_sets[1 - self.shm_current]
        known = max(expected or 0, other.used if other is not None else 0)
        self.shm_sets[self.shm_current].rewind(known or None)

    def shm_committed(self) -> None:
        """Every server committed this update: its set is live, the other may be written."""
        self.shm_live = self.shm_current

    def pack(self, meta: WeightUpdateMeta, slot: int, bucket: Bucket, dtype: torch.dtype | None) -> Packed:
        """Cast `bucket` into its send memory (flat buffer `slot`, or the bucket's shm segment)."""
        tensors = [t.detach() if t.requires_grad else t for _, t in bucket]  # exports are detached already
        if meta.type == "shm" and tensors[0].is_cuda:
            names = [n for n, _ in bucket]
            specs = _specs(names, [t.shape for t in tensors], [dtype or t.dtype for t in tensors])
            buf, handle, offsets, nbytes = cuda_ipc_handle(tensors, dtype)
            self.keep.append(buf)
            views = tensor_views(buf, offsets, [s.shape for s in specs], [dtype_from_name(s.dtype) for s in specs])
            return Packed(names, specs, offsets, nbytes, views, shm=ShmBucket(specs, tuple(offsets), nbytes,
                                                                                cuda_ipc=handle))
        device = torch.device("cpu") if meta.type == "shm" or meta.backend == "gloo" else tensors[0].device
        packed = self._place(meta, slot, [(n, t) for (n, _), t in zip(bucket, tensors, strict=True)], dtype, device)
        for view, t in zip(packed.views, tensors, strict=True):
            view.copy_(t)  # the cast writes straight into the send memory
        return packed

    def reserve(self, meta: WeightUpdateMeta, slot: int, names: Sequence[str], shapes: Sequence[torch.Size],
                dtype: torch.dtype, device: torch.device) -> Packed | None:
        """Room for a bucket not yet gathered, exactly where `pack` would put it, for the export
        to write the gathered tensors into (`Packed.views`, uninitialised); None when the bucket
        would not live on `device` (gloo from a GPU, CUDA IPC): the export allocates, `pack` copies."""
        if meta.type == "shm":
            if device.type != "cpu":
                return None
        elif (torch.device("cpu") if meta.backend == "gloo" else device) != device:
            return None
        shells = [(n, torch.empty(shape, dtype=dtype, device="meta")) for n, shape in zip(names, shapes, strict=True)]
        return self._place(meta, slot, shells, dtype, device)

    def _place(self, meta: WeightUpdateMeta, slot: int, bucket: Bucket, dtype: torch.dtype | None,
               device: torch.device) -> Packed:
        """Where the bucket goes (offsets, views; nothing copied): the next window of this update's
        shm segment, or flat buffer `slot` on `device`. Only shapes and dtypes of `bucket` count."""
        names = [n for n, _ in bucket]
        tensors = [t for _, t in bucket]
        specs = _specs(names, [t.shape for t in tensors], [dtype or t.dtype for t in tensors])
        if meta.type == "shm":
            name, offsets, nbytes, views = self.shm.reserve(tensors, dtype)
            return Packed(names, specs, offsets, nbytes, views,
                          shm=ShmBucket(specs, tuple(offsets), nbytes, segment=name, zero_copy=True))
        offsets, nbytes = layout(tensors, dtype)
        buf = self.flat.get(slot, nbytes, device)
        views = tensor_views(buf, offsets, [t.shape for t in tensors], [dtype or t.dtype for t in tensors])
        return Packed(names, specs, offsets, nbytes, views, flat=buf)

    def release_shm(self) -> None:
        """Unlink both sets of segments and drop the CUDA IPC buffers."""
        for writer in self.shm_sets:
            if writer is not None:
                writer.close()
        self.shm_sets, self.shm_live = [None, None], None
        self.keep.clear()

    def clear(self) -> None:
        self.flat.clear()


def _specs(names: Sequence[str], shapes: Sequence[torch.Size], dtypes: Sequence[torch.dtype]) -> tuple[ParamSpec, ...]:
    return tuple(ParamSpec(n, tuple(shape), str(d).removeprefix("torch."))
                 for n, shape, d in zip(names, shapes, dtypes, strict=True))


def merge_packed(group: Sequence[Packed]) -> Packed:
    """Buckets packed one after another into the same shm segment, as one bucket (one announcement
    of the window they span)."""
    first = group[0].shm
    names = [n for p in group for n in p.names]
    specs = tuple(spec for p in group for spec in p.specs)
    offsets = [o for p in group for o in p.offsets]
    return Packed(names, specs, offsets, first.nbytes, [],
                  shm=dataclasses.replace(first, specs=specs, offsets=tuple(offsets)))


def broadcast_all(group: WeightGroup, tensors: Sequence[torch.Tensor], timeout_s: float) -> float:
    """Broadcast each tensor from rank 0, in order; -> the seconds it took."""
    start = time.perf_counter()
    for t in tensors:
        group.broadcast(t, src=0, timeout_s=timeout_s)
    return time.perf_counter() - start


def export_buckets(engine: Any, world_size: int, dtype: torch.dtype | None, bucket_bytes: int,
                   alloc: Alloc | None = None) -> tuple[torch.dtype | None, Iterator[Bucket]]:
    """(dtype on the wire, buckets of `(hf_name, tensor)`). At trainer world size 1 with plain
    parameters the buckets hold the parameters themselves, uncast: `SendBuffers.pack` casts them
    straight into the flat buffer / segment, so no tensor is allocated per bucket. Otherwise (FSDP
    world > 1, or an engine that is not a TrainEngine) the engine's own export (gathers, the cast
    happening on the shard) in `dtype`, gathered to rank 0 alone and into `alloc`'s tensors (the
    send memory, see `SendBuffers.reserve`) when the engine takes `alloc` and `dst`; else the
    pack copies into the send memory."""
    wire = dtype or getattr(engine, "param_dtype", None)
    if world_size == 1 and wire is not None:
        params = plain_parameters(engine)
        if params is not None:
            return wire, plan_buckets(params, bucket_bytes, wire)
    if {"alloc", "dst"} <= inspect.signature(engine.export_weights).parameters.keys():
        # Rank 0 alone needs the tensors: shards travel to it only, into its send memory.
        return dtype, iter(engine.export_weights(bucket_bytes, dtype, alloc=alloc, dst=0))
    return dtype, iter(engine.export_weights(bucket_bytes, dtype))


def lives_in(bucket: Bucket, packed: Packed) -> bool:
    """Whether the bucket's tensors are `packed`'s views (the export wrote into the reservation)."""
    return len(bucket) == len(packed.views) and all(
        t.data_ptr() == v.data_ptr() and t.shape == v.shape and t.dtype == v.dtype
        for (_, t), v in zip(bucket, packed.views, strict=True))


def expected_bytes(engine: Any, dtype: torch.dtype | None) -> int | None:
    """About how many bytes an export of `engine` takes in `dtype` (each tensor 64-byte aligned), from
    its model's parameters (global shapes under FSDP); None without a model."""
    model = getattr(engine, "model", None)
    if model is None or not hasattr(model, "parameters"):
        return None
    total = 0
    for param in model.parameters():
        total += -(-param.numel() * (dtype or param.dtype).itemsize // ALIGN) * ALIGN
    return total or None


def plain_parameters(engine: Any) -> Bucket | None:
    """(HF name, whole parameter) of a single-process engine's model in export order, or None when
    the engine has no such model (then its own `export_weights` is used)."""
    model = getattr(engine, "model", None)
    if model is None or not hasattr(model, "spec"):
        return None
    try:
        from torch.distributed.tensor import DTensor

        from tandem.train import TrainEngine
        from tandem.train.weight_export import hf_parameter_names

        if getattr(type(engine), "export_weights", None) is not TrainEngine.export_weights:
            return None  # an engine with its own export (e.g. merging adapters): use it

        out = []
        with torch.no_grad():  # to_local is then the shard itself, not an autograd op
            for _, hf_name, param in hf_parameter_names(model):
                t = param
                if isinstance(t, DTensor):  # FSDP over a mesh of one: the local shard is the whole tensor
                    if t.device_mesh.size() != 1:
                        return None
                    t = t.to_local()
                    if t.shape != param.shape:
                        return None
                # Detach the plain tensor: a DTensor's detach dispatches through DTensor (~12 us
                # a parameter, a few ms an update).
                out.append((hf_name, t.detach()))
        return out
    except Exception:
        return None


def plan_buckets(params: Bucket, bucket_bytes: int, dtype: torch.dtype) -> Iterator[Bucket]:
    """The same boundaries as `iter_weight_buckets` (at most `bucket_bytes` in `dtype`; a larger
    tensor travels alone), over uncast parameters."""
    bucket: Bucket = []
    size = 0
    for name, t in params:
        nbytes = t.numel() * dtype.itemsize
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, t))
        size += nbytes
    if bucket:
        yield bucket

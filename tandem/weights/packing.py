"""Rank 0's data plane of a weight update: which tensors form each bucket, and where a bucket's
bytes live on their way out. No fleet calls here (the transports do those).

- `export_buckets`: the buckets of `(hf_name, tensor)` to send: a one-rank trainer's parameters
  themselves, uncast (`plan_buckets` gives the same boundaries as the engine's export), or the
  source's own export (gathers, a collective every rank joins), gathered into `alloc`'s memory.
- `Packed`: one bucket at 64-byte-aligned offsets in its send memory (a flat buffer, an shm
  segment or a CUDA IPC buffer), with views of its tensors.
- `FlatBuffers`: flat uint8 send buffers kept between updates, so no bucket allocates.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from tandem.fleet.ops import ParamSpec, ShmBucket
from tandem.weights.group import dtype_from_name
from tandem.weights.shm import tensor_views
from tandem.weights.source import Alloc, Bucket, WeightSource


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


def specs_of(names: Sequence[str], shapes: Sequence[torch.Size],
             dtypes: Sequence[torch.dtype]) -> tuple[ParamSpec, ...]:
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


def export_buckets(source: WeightSource, world_size: int, dtype: torch.dtype | None, bucket_bytes: int,
                   alloc: Alloc | None = None) -> tuple[torch.dtype | None, Iterator[Bucket]]:
    """(dtype on the wire, buckets of `(hf_name, tensor)`). A one-rank trainer's buckets hold its
    parameters themselves, uncast (the packing casts them straight into the send memory, so no
    tensor is allocated per bucket); otherwise the source's export in `dtype`, gathered to rank 0
    alone and into `alloc`'s tensors (the send memory) when it gives some."""
    wire = dtype or source.param_dtype
    if world_size == 1 and wire is not None:
        params = source.local_weights()
        if params is not None:
            return wire, plan_buckets(params, bucket_bytes, wire)
    return dtype, iter(source.export_weights(bucket_bytes, dtype, alloc=alloc, dst=0))


def lives_in(bucket: Bucket, packed: Packed) -> bool:
    """Whether the bucket's tensors are `packed`'s views (the export wrote into the reservation)."""
    return len(bucket) == len(packed.views) and all(
        t.data_ptr() == v.data_ptr() and t.shape == v.shape and t.dtype == v.dtype
        for (_, t), v in zip(bucket, packed.views, strict=True))


def plan_buckets(params: Sequence[Bucket], bucket_bytes: int, dtype: torch.dtype) -> Iterator[Bucket]:
    """The same boundaries as the engine's export over uncast parameters, given per parameter as
    its HF pieces (`local_weights`): at most `bucket_bytes` in `dtype`, cut between parameters (a
    parameter's pieces travel together; a larger parameter travels alone)."""
    bucket: Bucket = []
    size = 0
    for pieces in params:
        nbytes = sum(t.numel() for _, t in pieces) * dtype.itemsize
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.extend(pieces)
        size += nbytes
    if bucket:
        yield bucket

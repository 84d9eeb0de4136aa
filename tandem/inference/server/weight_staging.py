"""The pieces of a staged weight update that need no server state (`WeightReceiver` holds that):
the buckets received so far (`Staging`), the broadcasts that receive a bucket over the weight
group, and the window of a shared-memory segment a bucket occupies.
"""

from __future__ import annotations

import math
import os
import signal
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from tandem.inference.server.protocol import ControlError
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


def receive(group: WeightGroup, shapes: Sequence[Sequence[int]], dtypes: Sequence[torch.dtype],
            kill_after: int | None = None) -> list[torch.Tensor]:
    """One broadcast (from rank 0) per tensor, into fresh memory. `kill_after` (fault injection):
    SIGKILL this process after that many tensors."""
    out = []
    for shape, dtype in zip(shapes, dtypes, strict=True):
        if kill_after is not None and len(out) >= kill_after:
            os.kill(os.getpid(), signal.SIGKILL)  # injected fault: die mid-broadcast
        out.append(group.broadcast(torch.empty(shape, dtype=dtype, device=group.device), src=0))
    return out


def receive_flat(group: WeightGroup, buf: torch.Tensor, offsets: Sequence[int], shapes: Sequence[Sequence[int]],
                 dtypes: Sequence[torch.dtype], kill_after: int | None = None) -> list[torch.Tensor]:
    """One broadcast into `buf`; -> the tensors as views of it ([] when the layout does not fit,
    which the caller reported before receiving). `kill_after` (any value): SIGKILL first."""
    if kill_after is not None:
        os.kill(os.getpid(), signal.SIGKILL)  # injected fault: die as the bucket's one broadcast starts
    group.broadcast(buf, src=0)
    try:
        return tensor_views(buf, offsets, shapes, dtypes)
    except ShmError:  # a bad layout was reported before receiving; the bytes are dropped
        return []


def byte_window(offsets: Sequence[int], shapes: Sequence[Sequence[int]], dtypes: Sequence[torch.dtype],
                nbytes: int) -> tuple[int, int]:
    """Bytes [start, end) of a segment of `nbytes` that a bucket's tensors occupy; ControlError
    when they do not fit in it."""
    if not offsets:
        raise ControlError("a shared-memory bucket needs at least one tensor")
    ends = [o + math.prod(s) * d.itemsize for o, s, d in zip(offsets, shapes, dtypes, strict=True)]
    start, end = min(offsets), max(ends)
    if start < 0 or end > nbytes:
        raise ControlError(f"tensors span bytes [{start}, {end}) but the segment has nbytes={nbytes}; "
                           "offsets and nbytes must describe the segment")
    return start, max(end, start + 1)

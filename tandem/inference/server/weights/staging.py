"""The pieces of a staged weight update that need no server state (`WeightReceiver` holds that):
the buckets received so far (`Staging`) and the window of a shared-memory segment a bucket occupies.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from tandem.inference.server.http_api import ControlError


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
    lora_alpha: float | None = None  # a LoRA adapter's tensors, with this alpha (`AdapterMerger`)

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

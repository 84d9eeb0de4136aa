"""Receiving a bucket over the weight group (the server side of the broadcast transport): one
broadcast per tensor, or one flat buffer split into views. Used by `tandem serve` and by Tandem's
vLLM worker extension (`tandem.weights.vllm_worker`)."""

from __future__ import annotations

import os
import signal
from collections.abc import Sequence

import torch

from tandem.weights.group import WeightGroup
from tandem.weights.shm import ShmError, tensor_views


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

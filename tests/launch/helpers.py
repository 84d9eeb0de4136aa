"""Functions the launch tests run inside trainer workers through `TrainWorker.call`
(`fn(worker, *args)`); workers import them by dotted path."""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist


def all_reduce_sum(worker, value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t)
    return float(t.item())


def echo(worker, tensors):
    """Returns what it got, plus proof of which rank saw it."""
    return worker.rank, tensors


def checksum(worker, tensors) -> float:
    return float(sum(t.double().sum() for t in tensors))


def exit_on_rank(worker, rank: int, code: int) -> None:
    """`rank` leaves abruptly; the others block in a collective that will never complete."""
    if worker.rank == rank:
        time.sleep(0.2)  # let the others enter the collective first
        os._exit(code)
    t = torch.ones(1)
    dist.all_reduce(t)


def sleep(worker, seconds: float) -> int:
    time.sleep(seconds)
    return worker.rank


def fail_on_rank(worker, rank: int) -> int:
    if worker.rank == rank:
        raise ValueError(f"deliberate failure on rank {rank}")
    return worker.rank


def make_segments(worker, count: int) -> list[str]:
    """Rank 0 writes `count` weight segments the way `WeightUpdater` does, and keeps them (the
    writer lives in `worker.state`); -> their names."""
    from tandem.weights.shm import ShmWriter

    names = []
    for _ in range(count):
        writer = ShmWriter()
        names.append(writer.write([torch.ones(1000)])[0])
        worker.state.setdefault("writers", []).append(writer)
    return names


def resource_tracker_pid(worker) -> int | None:
    from multiprocessing import resource_tracker

    return resource_tracker._resource_tracker._pid

"""A trainer worker with extra RPCs for the launch tests, served the way `tandem.train.worker` is:

    sched.start_workers(n, HELPERS, args=["--device", "cpu"])   # -> python -m tests.launch.helpers

The tests name its methods (`group.call(HelperWorker.echo, ...)`) like a controller names
`TrainWorker`'s.
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch
import torch.distributed as dist

from tandem.train.worker import TrainWorker, main

HELPERS = "tests.launch.helpers"
CPU = ["--device", "cpu"]


class HelperWorker(TrainWorker):
    """`TrainWorker` plus test-only methods."""

    def __init__(self, rank: int, world_size: int, device: torch.device, backend: str):
        super().__init__(rank, world_size, device, backend)
        self.writers: list[Any] = []  # weight segment writers kept alive between calls

    def all_reduce_sum(self, value: float) -> float:
        t = torch.tensor([value], dtype=torch.float64)
        dist.all_reduce(t)
        return float(t.item())

    def echo(self, tensors: list[torch.Tensor]) -> tuple[int, list[torch.Tensor]]:
        """Returns what it got, plus proof of which rank saw it."""
        return self.rank, tensors

    def checksum(self, tensors: list[torch.Tensor]) -> float:
        return float(sum(t.double().sum() for t in tensors))

    def exit_on_rank(self, rank: int, code: int) -> None:
        """`rank` leaves abruptly; the others block in a collective that will never complete."""
        if self.rank == rank:
            time.sleep(0.2)  # let the others enter the collective first
            os._exit(code)
        t = torch.ones(1)
        dist.all_reduce(t)

    def sleep(self, seconds: float) -> int:
        time.sleep(seconds)
        return self.rank

    def fail_on_rank(self, rank: int) -> int:
        if self.rank == rank:
            raise ValueError(f"deliberate failure on rank {rank}")
        return self.rank

    def make_segments(self, count: int) -> list[str]:
        """Rank 0 writes `count` weight segments the way `WeightUpdater` does, and keeps them
        (the writers stay in `self.writers`); -> their names."""
        from tandem.weights.shm import ShmWriter

        names = []
        for _ in range(count):
            writer = ShmWriter()
            names.append(writer.write([torch.ones(1000)])[0])
            self.writers.append(writer)
        return names

    def resource_tracker_pid(self) -> int | None:
        from multiprocessing import resource_tracker

        return resource_tracker._resource_tracker._pid


if __name__ == "__main__":
    main(worker_type=HelperWorker)

"""The staleness bound: how many episodes may start now.

    capacity(v) = min(max(1, max_concurrent_rollouts) - running,
                      (max_staleness + v + 1) * max(1, consumer_batch_size) - (accepted + running))

The first term caps concurrency. The second lets the fleet run at most `max_staleness` batches
ahead of the trainer: at version v the trainer has consumed v batches, so accepted + running may
reach the end of batch `v + max_staleness`. Accepted episodes consume that budget for good;
rejected ones free their slot. See docs/rollout.md for what this guarantees per trajectory.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass


@dataclass(frozen=True)
class StalenessStats:
    submitted: int
    accepted: int
    rejected: int
    running: int


class StalenessManager:
    def __init__(self, max_concurrent_rollouts: int, consumer_batch_size: int, max_staleness: int):
        if max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0, got {max_staleness}")
        self.max_concurrent_rollouts = max_concurrent_rollouts
        self.consumer_batch_size = consumer_batch_size
        self.max_staleness = max_staleness
        self._lock = threading.Lock()
        self._submitted = 0
        self._accepted = 0
        self._rejected = 0
        self._running = 0

    def capacity(self, version: int) -> int:
        """How many more episodes may start at trainer version `version` (may be negative)."""
        with self._lock:
            concurrency = max(1, self.max_concurrent_rollouts) - self._running
            budget = (self.max_staleness + version + 1) * max(1, self.consumer_batch_size)
            return min(concurrency, budget - (self._accepted + self._running))

    def on_submit(self) -> None:
        with self._lock:
            self._submitted += 1
            self._running += 1

    def on_accept(self) -> None:
        with self._lock:
            self._running -= 1
            self._accepted += 1

    def on_reject(self) -> None:
        with self._lock:
            self._running -= 1
            self._rejected += 1

    def on_version_recovered(self, version: int) -> None:
        """After a restart at `version`: the trainer consumed `version` full batches before it."""
        with self._lock:
            self._accepted = version * self.consumer_batch_size

    def stats(self) -> StalenessStats:
        with self._lock:
            return StalenessStats(self._submitted, self._accepted, self._rejected, self._running)

"""`WeightVersion`: the weight version the rollout side generates under, an int with one writer.

The controller sets it once every server acknowledged a version (`set_version`), or on resume; the
inference client reads it (the version of tokens a server did not tag), the executor reads it (the
staleness bound counts from it) and wakes on change, and the rollout worker pool forwards each
change to its processes. Nothing else keeps a copy.
"""

from __future__ import annotations

import threading
from collections.abc import Callable


class WeightVersion:
    def __init__(self, value: int = 0):
        self._value = value
        self._lock = threading.Lock()
        self._watchers: list[Callable[[int], None]] = []

    @property
    def value(self) -> int:
        return self._value

    def set(self, value: int) -> None:
        """Move to `value` and tell every watcher (in the caller's thread, in watch order)."""
        with self._lock:
            self._value = value
            watchers = list(self._watchers)
        for watcher in watchers:
            watcher(value)

    def watch(self, watcher: Callable[[int], None]) -> None:
        """Call `watcher(value)` after every `set` from now on."""
        with self._lock:
            self._watchers.append(watcher)

    def __repr__(self) -> str:
        return f"WeightVersion({self._value})"

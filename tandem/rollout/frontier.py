"""The trained frontier of a run's item stream, and the sampling seeds derived from it.

Each drawn item carries its stream position (`item[STREAM_INDEX]`); it is *resolved* once its
episode was handed to the trainer or rejected. The frontier is the lowest unresolved position;
`FrontierState` (the frontier and the resolved positions beyond it) is what a checkpoint saves, so
a resumed run trains no item twice and skips none. `sampling_seed` (run seed, position, sample
index) and `continuation_seed` make an item drawn again ask for the same tokens. See
docs/recovery.md."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

STREAM_INDEX = "stream_index"  # the key a loader sets on each item it draws
MAX_SEED = 2**63 - 1  # servers take signed 64-bit seeds


def stream_index_of(item: Any) -> int | None:
    """The item's position in the run's stream, or None (not drawn from one)."""
    if isinstance(item, dict) and isinstance(item.get(STREAM_INDEX), int):
        return int(item[STREAM_INDEX])
    return None


@dataclass(frozen=True)
class FrontierState:
    next_index: int = 0  # every position below is resolved
    resolved: tuple[int, ...] = field(default_factory=tuple)  # resolved positions above next_index

    def to_dict(self) -> dict[str, Any]:
        return {"next_index": self.next_index, "resolved": list(self.resolved)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> FrontierState:
        return cls(int(data["next_index"]), tuple(sorted(int(i) for i in data.get("resolved", ()))))


class DrawFrontier:
    """Tracks resolved positions (callers serialise access: the executor's lock)."""

    def __init__(self, state: FrontierState | None = None):
        state = state or FrontierState()
        self._next = state.next_index
        self._resolved = {i for i in state.resolved if i >= self._next}
        self.trained = 0  # items handed to the trainer (resolve(..., trained=True)) since the start

    def resolve(self, index: int, trained: bool = False) -> None:
        self.trained += trained
        if index < self._next:
            return
        self._resolved.add(index)
        while self._next in self._resolved:
            self._resolved.remove(self._next)
            self._next += 1

    def state(self) -> FrontierState:
        return FrontierState(self._next, tuple(sorted(self._resolved)))


def _hash(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") & MAX_SEED


def sampling_seed(run_seed: int, stream_index: int, sample: int) -> int:
    """The seed of sample `sample` of the item at `stream_index` in the run seeded `run_seed`:
    sample 0's plus `sample`, the rule of a server asked for n samples at once (sample 0's seed is
    below 2**62, so any sample's stays a signed 64-bit seed)."""
    return (_hash(f"{run_seed}:{stream_index}") >> 1) + sample


def continuation_seed(seed: int, tokens_before: int) -> int:
    """The seed of a call that continues a seeded request after `tokens_before` tokens (resubmitted
    after an abort): fresh randomness, yet the same in every rerun that aborts there."""
    return seed if tokens_before == 0 else _hash(f"{seed}+{tokens_before}")

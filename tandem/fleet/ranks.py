"""The ranks of a weight-transfer group: trainer rank 0 is group rank 0, then each server's devices
in member order. Server i's device j (its tensor/pipeline-parallel rank j) is group rank
`1 + sum(devices of servers 0..i-1) + j`; the world is `1 + sum(devices)`. Every adapter's join
call and the broadcast transport take both from `group_ranks`, so offsets and world cannot
disagree. See docs/weight-sync.md, "Group ranks"."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class GroupRanks:
    """`devices[i]`: how many ranks server i occupies (its devices, each one a receiving worker)."""

    devices: tuple[int, ...]

    def __post_init__(self) -> None:
        bad = [d for d in self.devices if isinstance(d, bool) or not isinstance(d, int) or d < 1]
        if bad:
            raise ValueError(f"every server occupies at least one rank; got devices {list(self.devices)}")

    @property
    def world_size(self) -> int:
        """The trainer's rank 0 and every server device."""
        return 1 + sum(self.devices)

    @property
    def offsets(self) -> tuple[int, ...]:
        """The group rank of each server's first device (`rank_offset` in SGLang's and vLLM's join calls)."""
        if not self.devices:
            return ()
        return tuple(1 + before for before in itertools.accumulate(self.devices[:-1], initial=0))

    def ranks_of(self, server: int) -> range:
        """The group ranks of server `server`'s devices."""
        start = self.offsets[server]
        return range(start, start + self.devices[server])


def group_ranks(devices: Sequence[int]) -> GroupRanks:
    """The group of servers with `devices[i]` devices each, in this order."""
    return GroupRanks(tuple(devices))

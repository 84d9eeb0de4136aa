"""The fleet interface: what trainer rank 0 may ask of the inference servers.

Trainer code calls these methods and never learns who answers: `HttpFleet` talks to a list of
server addresses directly; the controller's `RolloutCallback` forwards each call to the controller,
which fans it out to every healthy server it knows. Calls that the trainer must overlap with its
own collectives (forming the group, one bucket's receive, a disk load) return a `Future`; pause,
continue, set_version, commit and discard block until every server answered.

A fleet call succeeds as a whole or raises `FleetError`, which names the phase and, for every
server that failed, its address and what it said.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Protocol

from tandem.errors import TandemError
from tandem.weights.meta import FlatLayout, ParamSpec, ShmBucket, WeightUpdateMeta


@dataclass(frozen=True)
class ServerResult:
    address: str
    success: bool
    message: str = ""


@dataclass(frozen=True)
class FleetResult:
    """Per-server outcomes of one fleet call."""

    phase: str
    results: tuple[ServerResult, ...] = field(default_factory=tuple)

    @property
    def failures(self) -> tuple[ServerResult, ...]:
        return tuple(r for r in self.results if not r.success)

    def raise_for_failures(self) -> FleetResult:
        if self.failures:
            raise FleetError(self.phase, self.failures)
        return self


class FleetError(TandemError, RuntimeError):
    def __init__(self, phase: str, failures: Sequence[ServerResult]):
        self.phase = phase
        self.failures = tuple(failures)
        detail = "; ".join(f"{f.address}: {f.message}" for f in self.failures) or "no server answered"
        super().__init__(f"weight update phase {phase!r} failed on {len(self.failures)} server(s): {detail}")


@dataclass(frozen=True)
class ServerChecksums:
    """sha256 per tensor (HF name) of one server's weights, as served in `dtype`."""

    dtype: str
    checksums: dict[str, str]
    weight_version: str = ""


class Fleet(Protocol):
    """The servers, as seen from trainer rank 0.

    Futures resolve to the `FleetResult` or raise `FleetError`. Transfers may be staged
    (`commit=False`, bucket k of an update carries `bucket_index=k`): nothing changes on a server
    until `commit_weights`, and `discard_weights` drops what was staged, so a fleet either moves
    to the new weights everywhere or keeps the previous ones."""

    def pause_generation(self) -> FleetResult: ...

    def continue_generation(self) -> FleetResult: ...

    def init_weights_update_group(self, meta: WeightUpdateMeta) -> Future[FleetResult]:
        """Ask every server to join the transfer group (trainer = rank 0, servers from 1 on);
        the trainer forms its side concurrently and then waits on the future."""
        ...

    def update_weights_from_distributed(
        self, meta: WeightUpdateMeta, specs: Sequence[ParamSpec], *, commit: bool = True,
        bucket_index: int | None = None, flat: FlatLayout | None = None,
    ) -> Future[FleetResult]:
        """Announce one bucket; servers then receive `broadcast(src=0)` for each spec in order, or
        with `flat`, ONE broadcast of a uint8 buffer of `flat.nbytes` holding every tensor at its
        offset. Only fleets whose `supports_flat_buckets` is true accept `flat`."""
        ...

    def update_weights_from_shm(
        self, meta: WeightUpdateMeta, bucket: ShmBucket, *, commit: bool = True, bucket_index: int | None = None,
    ) -> Future[FleetResult]:
        """Every server copies one bucket out of shared memory on its host."""
        ...

    def destroy_weights_update_group(self, meta: WeightUpdateMeta) -> FleetResult: ...

    def update_weights_from_disk(self, meta: WeightUpdateMeta, *, commit: bool = True) -> Future[FleetResult]:
        """Every server loads `meta.versioned_path()`."""
        ...

    def commit_weights(self, meta: WeightUpdateMeta) -> FleetResult:
        """Swap in what was staged, under `meta.version_name`."""
        ...

    def discard_weights(self, meta: WeightUpdateMeta) -> FleetResult:
        """Drop what was staged; the previous weights keep serving."""
        ...

    def set_version(self, version: int) -> FleetResult: ...

    def weight_checksums(self, names: Sequence[str] | None = None) -> dict[str, ServerChecksums]:
        """Per server address: checksums of its served weights (all tensors when `names` is None)."""
        ...

    @property
    def world_size(self) -> int:
        """Ranks the servers occupy in the transfer group (sum of their tp * pp)."""
        ...

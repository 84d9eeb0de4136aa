"""The fleet operations, declared once: name, request type, answer type, deadline class, whether a
failure takes the server out of routing, whether a retry is safe, whether it only reads.

Every layer (the direct HTTP fleet, the controller's callback route, the trainer-side callback) and
every server adapter works from `OPS`; none names an operation except where it adds behaviour
around it (the controller pauses dispatch around `pause_generation`, for instance). Requests are
frozen dataclasses of plain values, so `tandem.fleet.wire` can carry any of them as JSON. Weight
versions are ints here; adapters write them in each server's own form.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Generic, TypeVar

from tandem.fleet.ranks import GroupRanks, group_ranks
from tandem.fleet.results import ServerChecksums

Req = TypeVar("Req")
Ans = TypeVar("Ans")


class Deadline(enum.Enum):
    """Which of `Deadlines` bounds an operation on each server."""

    CONTROL = "http_s"  # pause, continue, version, discard, destroy: quick control calls
    GROUP = "init_group_s"  # every server joined the transfer group
    BUCKET = "bucket_s"  # one bucket announced, received and acknowledged
    LOAD = "update_s"  # a whole checkpoint read from disk, or checksums of every tensor
    COMMIT = "commit"  # the larger of CONTROL and BUCKET: the swap checks every staged value


@dataclass(frozen=True)
class Deadlines:
    """Seconds each phase may take before the call fails with an error naming the phase."""

    init_group_s: float = 60.0
    bucket_s: float = 60.0
    update_s: float = 600.0  # also the whole update, pause to continue
    http_s: float = 30.0

    def seconds(self, deadline: Deadline) -> float:
        if deadline is Deadline.COMMIT:
            return max(self.http_s, self.bucket_s)
        return float(getattr(self, deadline.value))


# -- what requests carry -----------------------------------------------------------------------------
@dataclass(frozen=True)
class ParamSpec:
    """Name (HF), shape and dtype name ("float32", "bfloat16", ...) of one tensor in a bucket."""

    name: str
    shape: tuple[int, ...]
    dtype: str


@dataclass(frozen=True)
class FlatLayout:
    """A bucket as ONE flat uint8 buffer of `nbytes`: tensor i starts at `offsets[i]` (a multiple
    of 64). One broadcast per bucket instead of one per tensor."""

    offsets: tuple[int, ...]
    nbytes: int


@dataclass(frozen=True)
class ShmBucket:
    """A bucket in shared memory: tensor specs and byte offsets in a segment of `nbytes`, a
    /dev/shm file (`segment`) or a CUDA IPC handle (`cuda_ipc`). `zero_copy`: the writer leaves the
    segment alone while servers serve from it, so a server may use the tensors in place."""

    specs: tuple[ParamSpec, ...]
    offsets: tuple[int, ...]
    nbytes: int
    segment: str | None = None
    cuda_ipc: str | None = None
    zero_copy: bool = False


# -- requests, one per operation --------------------------------------------------------------------
@dataclass(frozen=True)
class PauseGeneration:
    """In-flight requests come back `abort` with their partial output; new ones wait."""


@dataclass(frozen=True)
class ContinueGeneration:
    pass


@dataclass(frozen=True)
class SetVersion:
    version: int


@dataclass(frozen=True)
class JoinGroup:
    """Join the transfer group hosted by trainer rank 0 (rank 0). `devices[i]`: the ranks target i
    of the call occupies (its devices, in the call's target order); its device j joins as rank
    `rank_offset(i) + j` of `world_size` (`tandem.fleet.ranks`)."""

    master_address: str
    master_port: int
    group_name: str
    backend: str
    devices: tuple[int, ...]
    timeout_s: float

    @property
    def ranks(self) -> GroupRanks:
        return group_ranks(self.devices)

    @property
    def world_size(self) -> int:
        return self.ranks.world_size

    def rank_offset(self, index: int) -> int:
        """The group rank of target `index`'s first device."""
        if not 0 <= index < len(self.devices):
            raise ValueError(f"join_group names the devices of {len(self.devices)} server(s) but was sent to "
                             f"server {index} of more; send it to exactly the servers of `devices`")
        return self.ranks.offsets[index]


@dataclass(frozen=True)
class DistributedBucket:
    """Receive one bucket over the group: one broadcast per spec, or one of `flat` when given."""

    group_name: str
    specs: tuple[ParamSpec, ...]
    bucket_index: int | None = None
    flat: FlatLayout | None = None
    commit: bool = True
    version: int | None = None
    lora_alpha: float | None = None  # the tensors are a LoRA adapter (PEFT names) with this alpha


@dataclass(frozen=True)
class SharedMemoryBucket:
    bucket: ShmBucket
    bucket_index: int | None = None
    commit: bool = True
    version: int | None = None
    lora_alpha: float | None = None  # the tensors are a LoRA adapter (PEFT names) with this alpha


@dataclass(frozen=True)
class DiskLoad:
    path: str
    commit: bool = True
    version: int | None = None
    adapter: bool = False  # `path` is a PEFT LoRA adapter directory, served over the base weights


@dataclass(frozen=True)
class CommitStaged:
    """Swap in what was staged (it must be a full set), under `version`. `announce`: nothing is
    checked after it, so a controller takes the successful commit as the version's announcement
    too (what `SetVersion` does), and no `SetVersion` follows: one round trip less per update.
    Only where the commit sets the servers' version (`Capabilities.commit_sets_version`).
    `abort_all`: in-flight requests are answered `abort` with their partial output in the same
    step as the swap (what a pause before it would do), so no pause or continue is needed. Only
    where the servers do both at once (`Capabilities.commit_aborts`)."""

    version: int
    announce: bool = False
    abort_all: bool = False


@dataclass(frozen=True)
class DiscardStaged:
    pass


@dataclass(frozen=True)
class LeaveGroup:
    group_name: str


@dataclass(frozen=True)
class ChecksumsRequest:
    """sha256 per served tensor; all of them when `names` is None, none (only the dtype) when ()."""

    names: tuple[str, ...] | None = None


@dataclass(frozen=True)
class Acknowledged:
    """The answer of an operation that returns nothing but success and a message."""


@dataclass(frozen=True)
class FleetOp(Generic[Req, Ans]):
    name: str
    request: type[Req]
    answer: type[Ans]
    deadline: Deadline
    marks_unhealthy: bool  # a server that fails it may be paused or serve other weights: stop routing to it
    idempotent: bool  # sending it twice has the effect of sending it once
    query: bool = False  # changes nothing on the servers (a fleet may keep what it knows of their state)
    # The servers act together (one transfer group): a failure on one spoils the outcome on all, so
    # a fleet cannot drop the failing server and keep the others' results (see `FleetView`).
    collective: bool = False


def _op(name: str, request: type, answer: type, deadline: Deadline, *, unhealthy: bool, idempotent: bool,
        query: bool = False, collective: bool = False) -> FleetOp:
    return FleetOp(name, request, answer, deadline, unhealthy, idempotent, query, collective)


PAUSE = _op("pause_generation", PauseGeneration, Acknowledged, Deadline.CONTROL, unhealthy=True, idempotent=True)
CONTINUE = _op("continue_generation", ContinueGeneration, Acknowledged, Deadline.CONTROL, unhealthy=True,
               idempotent=True)
SET_VERSION = _op("set_version", SetVersion, Acknowledged, Deadline.CONTROL, unhealthy=True, idempotent=True)
JOIN_GROUP = _op("join_group", JoinGroup, Acknowledged, Deadline.GROUP, unhealthy=False, idempotent=False,
                 collective=True)
LEAVE_GROUP = _op("leave_group", LeaveGroup, Acknowledged, Deadline.CONTROL, unhealthy=False, idempotent=False)
STAGE_DISTRIBUTED = _op("stage_distributed", DistributedBucket, Acknowledged, Deadline.BUCKET, unhealthy=True,
                        idempotent=False, collective=True)
STAGE_SHM = _op("stage_shm", SharedMemoryBucket, Acknowledged, Deadline.BUCKET, unhealthy=True, idempotent=False)
LOAD_DISK = _op("load_disk", DiskLoad, Acknowledged, Deadline.LOAD, unhealthy=True, idempotent=True)
COMMIT = _op("commit", CommitStaged, Acknowledged, Deadline.COMMIT, unhealthy=True, idempotent=False)
DISCARD = _op("discard", DiscardStaged, Acknowledged, Deadline.CONTROL, unhealthy=False, idempotent=True)
CHECKSUMS = _op("checksums", ChecksumsRequest, ServerChecksums, Deadline.LOAD, unhealthy=False, idempotent=True,
                query=True)


def announces_version(op: FleetOp, request: object) -> bool:
    """Whether `op` with `request`, once it succeeded, announces a weight version: `SET_VERSION`,
    or a `COMMIT` with `announce` (`CommitStaged`)."""
    return op is SET_VERSION or (op is COMMIT and isinstance(request, CommitStaged) and request.announce)


OPS: dict[str, FleetOp] = {op.name: op for op in (
    PAUSE, CONTINUE, SET_VERSION, JOIN_GROUP, LEAVE_GROUP, STAGE_DISTRIBUTED, STAGE_SHM, LOAD_DISK, COMMIT, DISCARD,
    CHECKSUMS)}

"""The `Transport` interface of a weight update, and `StreamingTransport`, the export loop shared
by the transports that send bucket by bucket (broadcast, shared memory).

A transport owns its buffers and in-flight state between updates. The two-phase update
(`tandem.weights.two_phase`) calls, per update: `prepare` (every rank, before the pause), `open`
(rank 0, generation paused), `stage` (every rank: the export is a collective; rank 0 sends each
bucket staged), then `committed` or `rollback` (rank 0), and `close` at the end of its life.
Every method that can fail returns the failure instead of raising, so the update always rolls
back and continues the servers.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from tandem.fleet.interface import Fleet
from tandem.weights.meta import WeightUpdateMeta
from tandem.weights.packing import Packed, export_buckets, lives_in
from tandem.weights.report import Clock, UpdateReport, WeightSyncError, timed
from tandem.weights.source import Bucket, WeightSource
from tandem.weights.verify import UpdateVerifier


@dataclass(frozen=True)
class TransportOptions:
    pipeline: bool = True  # pack bucket k + 1 while bucket k is on its way
    dtype: torch.dtype | None = None  # on the wire (None: the source's compute dtype)
    keep_group: bool = True  # broadcast: keep the transfer group between updates
    shm_reuse: bool = True  # shm: keep the segments between updates


class Transport(ABC):
    def __init__(self, source: WeightSource, fleet: Fleet | None, rank: int, world_size: int,
                 options: TransportOptions):
        self.source, self.fleet, self.rank, self.world_size, self.options = source, fleet, rank, world_size, options

    def retarget(self, fleet: Fleet) -> None:
        """Rank 0, between updates or attempts: send to `fleet` (a view of the servers this
        attempt works with) from now on."""
        self.fleet = fleet

    def prepare(self, meta: WeightUpdateMeta, report: UpdateReport) -> None:
        """Every rank, before generation pauses (may raise: nothing is paused yet)."""
        return None

    def open(self, meta: WeightUpdateMeta, clock: Clock, report: UpdateReport) -> WeightSyncError | None:
        """Rank 0, generation paused: whatever the transfer needs first (a transfer group)."""
        return None

    @abstractmethod
    def stage(self, meta: WeightUpdateMeta, clock: Clock, report: UpdateReport, failure: WeightSyncError | None,
              verifier: UpdateVerifier | None) -> WeightSyncError | None:
        """Every rank: move the weights to the servers, staged (nothing swapped). With a `failure`
        already, rank 0 sends nothing but every rank still joins the export's collectives."""

    def committed(self, meta: WeightUpdateMeta) -> None:
        """Rank 0: every server committed `meta.version`."""
        return None

    def rollback(self, meta: WeightUpdateMeta) -> None:
        """Rank 0: the update failed; drop what could be half-done (the servers discarded theirs)."""
        return None

    def close(self) -> None:
        """Release everything (every rank)."""
        return None


class StreamingTransport(Transport):
    """Iterates the export on every rank; rank 0 packs each bucket into its send memory (where
    the export may have gathered it already: `reserve`) and sends it (`send`), and at the end
    waits for everything in flight (`flush`)."""

    def begin(self, meta: WeightUpdateMeta, wire_dtype: torch.dtype | None) -> None:
        """Rank 0, before the first bucket."""
        return None

    @abstractmethod
    def reserve(self, meta: WeightUpdateMeta, k: int, names: list[str], shapes: list[torch.Size],
                dtype: torch.dtype, device: torch.device) -> Packed | None:
        """Room for bucket k before it is gathered, or None (the export allocates, `pack` copies)."""

    @abstractmethod
    def pack(self, meta: WeightUpdateMeta, k: int, bucket: Bucket, wire_dtype: torch.dtype | None) -> Packed: ...

    @abstractmethod
    def send(self, meta: WeightUpdateMeta, k: int, packed: Packed, clock: Clock,
             report: UpdateReport) -> WeightSyncError | None: ...

    @abstractmethod
    def flush(self, meta: WeightUpdateMeta, clock: Clock, report: UpdateReport, send: bool) -> WeightSyncError | None:
        """Wait for everything in flight (`send=False`: drop what was not sent yet)."""

    def stage(self, meta: WeightUpdateMeta, clock: Clock, report: UpdateReport, failure: WeightSyncError | None,
              verifier: UpdateVerifier | None) -> WeightSyncError | None:
        rank0 = self.rank == 0
        k = -1
        reserved: Packed | None = None

        def alloc(names, shapes, dtype, device):  # bucket k + 1 is gathered straight into its send memory
            nonlocal reserved
            if not rank0 or failure is not None or (self.options.dtype is not None and dtype != self.options.dtype):
                return None
            try:
                reserved = self.reserve(meta, k + 1, names, shapes, dtype, device)
            except Exception:  # e.g. /dev/shm full: raised again by `pack`, which fails the update
                return None  # (raising here would leave the other ranks in the next gather)
            return None if reserved is None else reserved.views

        wire_dtype, buckets = export_buckets(self.source, self.world_size, self.options.dtype, meta.bucket_bytes,
                                             alloc)
        if rank0:
            self.begin(meta, wire_dtype)
        while True:
            reserved = None
            with timed(report, "export"):  # the gather (a collective), or nothing on the fast path
                bucket = next(buckets, None)
            if bucket is None:
                break
            k += 1
            report.buckets += 1
            if not rank0:
                continue
            report.bytes += sum(t.numel() * (wire_dtype or t.dtype).itemsize for _, t in bucket)
            if failure is not None:
                continue
            try:
                with timed(report, "pack"):
                    if reserved is not None and lives_in(bucket, reserved):
                        packed = reserved  # gathered straight into its send memory
                        report.in_place += 1
                    else:
                        packed = self.pack(meta, k, bucket, wire_dtype)
            except Exception as exc:  # e.g. /dev/shm full: fail the update, keep iterating the gathers
                phase = f"stage_{meta.type} (bucket {k})"
                failure = WeightSyncError(f"{phase}: the trainer could not pack the bucket: "
                                          f"{type(exc).__name__}: {exc}", phase)
                self.flush(meta, clock, report, send=False)  # reap what is in flight before any teardown
                continue
            del bucket
            if verifier is not None:
                verifier.add(list(zip(packed.names, packed.views, strict=True)))
            packed.views = []  # shm: no exported view of a segment may outlive the write
            failure = self.send(meta, k, packed, clock, report)
        if rank0:
            failure = self.flush(meta, clock, report, send=failure is None) or failure
            if failure is None and report.buckets == 0:
                failure = WeightSyncError("the source exported no weights", "export")
        return failure

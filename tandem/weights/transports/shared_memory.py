"""Shared-memory transport (trainer and servers on one host): rank 0 casts the buckets back to back
into one /dev/shm segment (a CUDA IPC buffer per bucket on GPU), which the servers map and, at
commit, serve from without a copy.

Two segment sets are written in turn (ping-pong), so the trainer never writes the set the servers
serve from (`ShmBucket.zero_copy`). One announcement is in flight at a time, covering whatever was
cast meanwhile. Segments are kept between updates (`shm_reuse`) and unlinked at `close`, after a
failure, or (a dead trainer's) by the next transport; without `shm_reuse` when each update ends.
See docs/weight-sync.md, "Transports" (shm)."""

from __future__ import annotations

import time

import torch

from tandem.fleet import ops
from tandem.fleet.interface import Fleet
from tandem.weights.calls import InFlight
from tandem.weights.meta import WeightUpdateMeta
from tandem.weights.packing import Packed, merge_packed, specs_of
from tandem.weights.report import Clock, UpdateReport, WeightSyncError, timed
from tandem.weights.shm import ShmWriter, cuda_ipc_handle, remove_stale_segments, tensor_views
from tandem.weights.source import Bucket, WeightSource
from tandem.weights.transports.base import StreamingTransport, TransportOptions


class SharedMemoryTransport(StreamingTransport):
    def __init__(self, source: WeightSource, fleet: Fleet | None, rank: int, world_size: int,
                 options: TransportOptions):
        super().__init__(source, fleet, rank, world_size, options)
        self._sets: list[ShmWriter | None] = [None, None]
        self._live: int | None = None  # the set the servers serve from
        self._current = 0  # the set this update writes
        self._keep: list[torch.Tensor] = []  # CUDA IPC buffers, alive until the update ends
        self._pending: list[Packed] = []  # packed, not announced yet (in order)
        self._in_flight: InFlight | None = None
        self._sent = 0  # announcements this update: the servers' bucket index of the next one
        if self.rank == 0:
            remove_stale_segments()

    @property
    def _writer(self) -> ShmWriter:
        writer = self._sets[self._current]
        assert writer is not None, "begin() picks the set before the first bucket"
        return writer

    def begin(self, meta: WeightUpdateMeta, wire_dtype: torch.dtype | None) -> None:
        """Write the set that is not live, reusing its segments (sized by the expected bytes, or by
        the other set's last update)."""
        self._sent = 0
        self._current = 0 if self._live is None else 1 - self._live
        if self._sets[self._current] is None:
            self._sets[self._current] = ShmWriter()
        other = self._sets[1 - self._current]
        known = max(self.source.export_nbytes(wire_dtype) or 0, other.used if other is not None else 0)
        self._writer.rewind(known or None)

    # -- buckets (rank 0) ------------------------------------------------------------------------------
    def reserve(self, meta: WeightUpdateMeta, k: int, names: list[str], shapes: list[torch.Size],
                dtype: torch.dtype, device: torch.device) -> Packed | None:
        if device.type != "cpu":
            return None  # CUDA IPC: each bucket gets its own buffer in `pack`
        shells = [torch.empty(s, dtype=dtype, device="meta") for s in shapes]
        return self._segment_window(names, shells, dtype)

    def _segment_window(self, names: list[str], tensors: list[torch.Tensor], dtype: torch.dtype | None) -> Packed:
        specs = specs_of(names, [t.shape for t in tensors], [dtype or t.dtype for t in tensors])
        name, offsets, nbytes, views = self._writer.reserve(tensors, dtype)
        return Packed(names, specs, offsets, nbytes, views,
                      shm=ops.ShmBucket(specs, tuple(offsets), nbytes, segment=name, zero_copy=True))

    def pack(self, meta: WeightUpdateMeta, k: int, bucket: Bucket, wire_dtype: torch.dtype | None) -> Packed:
        names = [n for n, _ in bucket]
        tensors = [t.detach() if t.requires_grad else t for _, t in bucket]
        if tensors[0].is_cuda:
            specs = specs_of(names, [t.shape for t in tensors], [wire_dtype or t.dtype for t in tensors])
            buf, handle, offsets, nbytes = cuda_ipc_handle(tensors, wire_dtype)
            self._keep.append(buf)
            views = tensor_views(buf, offsets, [s.shape for s in specs], [wire_dtype or t.dtype for t in tensors])
            return Packed(names, specs, offsets, nbytes, views,
                          shm=ops.ShmBucket(specs, tuple(offsets), nbytes, cuda_ipc=handle))
        packed = self._segment_window(names, tensors, wire_dtype)
        for view, t in zip(packed.views, tensors, strict=True):
            view.copy_(t)  # the cast writes straight into the segment
        return packed

    def send(self, meta: WeightUpdateMeta, k: int, packed: Packed, clock: Clock,
             report: UpdateReport) -> WeightSyncError | None:
        self._pending.append(packed)
        if self.options.pipeline:
            return self._announce(meta, clock, report, wait=False)
        return self.flush(meta, clock, report, send=True)

    def flush(self, meta: WeightUpdateMeta, clock: Clock, report: UpdateReport, send: bool) -> WeightSyncError | None:
        if not send:
            self._pending.clear()
        while self._in_flight is not None or self._pending:
            failure = self._announce(meta, clock, report, wait=True)
            if failure is not None:
                return failure
        return None

    def _announce(self, meta: WeightUpdateMeta, clock: Clock, report: UpdateReport,
                  wait: bool) -> WeightSyncError | None:
        """Settle the announcement in flight (waiting for it only when `wait`; otherwise only if it
        is done) and announce what is pending, as one window."""
        if self._in_flight is not None:
            if not wait and not self._in_flight.fleet_future.done():
                return None
            item, self._in_flight = self._in_flight, None
            with timed(report, "wait"):
                failure = item.settle(report, [])
            if failure is not None:
                self._pending.clear()
                return failure
        if self._pending:
            window = self._take_window()
            request = ops.SharedMemoryBucket(window.shm, bucket_index=self._sent, commit=False,
                                             lora_alpha=meta.lora_alpha)
            deadline = time.monotonic() + clock.left(meta.deadlines.bucket_s)
            self._in_flight = InFlight(f"stage_shm (bucket {self._sent})", self.fleet.send(ops.STAGE_SHM, request),
                                       None, deadline)
            self._sent += 1
        return None

    def _take_window(self) -> Packed:
        """The leading pending buckets that lie in one segment, as one bucket (a CUDA IPC bucket
        goes alone: each has its own buffer)."""
        first = self._pending[0]
        count = 1
        if first.shm.segment is not None:
            while count < len(self._pending) and self._pending[count].shm.segment == first.shm.segment:
                count += 1
        group, self._pending = self._pending[:count], self._pending[count:]
        return first if count == 1 else merge_packed(group)

    # -- outcome -----------------------------------------------------------------------------------------
    def committed(self, meta: WeightUpdateMeta) -> None:
        self._live = self._current  # the servers serve from this set now; the other may be written
        self._keep.clear()
        if not self.options.shm_reuse:
            self._release()

    def rollback(self, meta: WeightUpdateMeta) -> None:
        # A server may still serve from either set: it keeps its mapping of the unlinked file, and
        # the next update writes fresh segments.
        self._release()

    def _release(self) -> None:
        for writer in self._sets:
            if writer is not None:
                writer.close()
        self._sets, self._live = [None, None], None
        self._keep.clear()

    def close(self) -> None:
        if self.rank == 0:
            self._release()

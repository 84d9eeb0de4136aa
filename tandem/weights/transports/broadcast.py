"""Broadcast transport: the weights go over a transfer group formed with the servers (trainer rank
0 is its rank 0, then every device of every server, `tandem.fleet.ranks`; gloo on CPU, NCCL on
GPU). Each device receives the whole bucket; a server of several devices loads its shards from it.

A bucket goes out as ONE broadcast of a flat send buffer when the servers take flat buckets
(`Capabilities.flat_buckets`), else one per tensor. Pipelined (default): bucket k + 1 is gathered
and cast while k is broadcast, at most one bucket in flight; serial: gather, send, wait, next. The
group is kept between updates (`keep_group`), torn down after a failure, and rebuilt at the next
`open` after `retarget` changed the servers. See docs/weight-sync.md, "Transports"."""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import torch
import torch.distributed as dist

from tandem.fleet import ops
from tandem.fleet.interface import Fleet, call
from tandem.weights.calls import InFlight, wait_for
from tandem.weights.group import WeightGroup, WeightGroupError, host_store, init_weight_group
from tandem.weights.meta import WeightUpdateMeta
from tandem.weights.packing import FlatBuffers, Packed, specs_of
from tandem.weights.report import Clock, UpdateReport, WeightSyncError, timed
from tandem.weights.shm import layout, tensor_views
from tandem.weights.source import Bucket, WeightSource
from tandem.weights.transports.base import StreamingTransport, TransportOptions


def broadcast_all(group: WeightGroup, tensors: Sequence[torch.Tensor], timeout_s: float) -> float:
    """Broadcast each tensor from rank 0, in order; -> the seconds it took."""
    start = time.perf_counter()
    for t in tensors:
        group.broadcast(t, src=0, timeout_s=timeout_s)
    return time.perf_counter() - start


def _in_thread(fn, *args, **kwargs) -> Future:
    """`fn(*args, **kwargs)` on a daemon thread of its own (one that blocks never holds up another
    call, nor the interpreter's exit); -> its future."""
    future: Future = Future()

    def run() -> None:
        try:
            future.set_result(fn(*args, **kwargs))
        except BaseException as exc:
            future.set_exception(exc)

    threading.Thread(target=run, name="tandem-weights-join", daemon=True).start()
    return future


def _destroy_formed(future: Future) -> None:
    """A trainer-side join nobody waits for any more: destroy the group if it formed after all."""
    if future.exception() is None:
        future.result().destroy()


class BroadcastTransport(StreamingTransport):
    def __init__(self, source: WeightSource, fleet: Fleet | None, rank: int, world_size: int,
                 options: TransportOptions):
        super().__init__(source, fleet, rank, world_size, options)
        self.group: WeightGroup | None = None
        self._store: dist.TCPStore | None = None
        self._buffers = FlatBuffers()
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="tandem-weights") if self.rank == 0 else None
        self._in_flight: InFlight | None = None
        self._stuck: list[Future] = []  # trainer-side broadcasts that outlived their deadline
        self._meta: WeightUpdateMeta | None = None  # the update that formed the group (its name, deadlines)
        self._members: list[str] = []  # the servers in the group, in rank order
        self._flat = False  # this update's buckets go as one flat broadcast each (the servers take them)
        self.groups_formed = 0

    @property
    def members(self) -> list[str]:
        """The servers in the current transfer group, in rank order (empty: no group)."""
        return list(self._members) if self.group is not None else []

    def retarget(self, fleet: Fleet) -> None:
        targets = list(fleet.topology().members)
        if self.group is not None and self._meta is not None and targets != self._members:
            self._teardown(self._meta)  # on the old members; the next `open` forms the new group
        self.fleet = fleet

    # -- group lifecycle (rank 0) ---------------------------------------------------------------------
    def open(self, meta: WeightUpdateMeta, clock: Clock, report: UpdateReport) -> WeightSyncError | None:
        if self.group is not None:
            return None
        with timed(report, "init_group"):
            return self._form_group(meta, clock)

    def _form_group(self, meta: WeightUpdateMeta, clock: Clock) -> WeightSyncError | None:
        timeout = clock.left(meta.deadlines.init_group_s)
        self._meta = meta
        try:
            self._store = host_store(meta.master_address, meta.master_port, timeout_s=max(timeout, 1.0))
        except Exception as exc:
            return WeightSyncError(f"cannot host the weight group's store on {meta.master_address}:"
                                   f"{meta.master_port}: {exc}", ops.JOIN_GROUP.name)
        topology = self.fleet.topology()
        self.groups_formed += 1
        self._members = list(topology.members)
        ranks = topology.ranks(self._members)
        join = ops.JoinGroup(meta.master_address, self._store.port, meta.group_name, meta.backend, ranks.devices,
                             max(meta.deadlines.init_group_s, meta.deadlines.bucket_s))
        world = join.world_size
        future = self.fleet.send(ops.JOIN_GROUP, join, self._members)  # target i is `ranks`' server i
        # The trainer's own join runs beside the servers' so that a member given up meanwhile (the
        # fleet's call fails at its eviction) is not waited for here either.
        local = _in_thread(init_weight_group, meta.master_address, self._store.port, 0, world, meta.group_name,
                           meta.backend, timeout_s=max(timeout, 1.0), store=self._store)
        cf.wait([future, local], timeout=clock.left(meta.deadlines.init_group_s) + 1.0,
                return_when=cf.FIRST_EXCEPTION)
        if future.done() and future.exception() is not None and not local.done():
            local.add_done_callback(_destroy_formed)  # it fails at its own timeout, or formed a group no one uses
            failure = wait_for(future, ops.JOIN_GROUP.name, 0.0)
        else:
            local_error = None
            try:
                self.group = local.result(timeout=max(0.0, clock.left(meta.deadlines.init_group_s)) + 1.0)
            except (WeightGroupError, cf.TimeoutError) as exc:
                local_error = str(exc) or "no group within the deadline"
                local.add_done_callback(_destroy_formed)
            failure = wait_for(future, ops.JOIN_GROUP.name, clock.left(meta.deadlines.init_group_s) + 1.0)
            if failure is None and local_error is not None:
                failure = WeightSyncError(f"join_group: the trainer could not form the group: {local_error}",
                                          ops.JOIN_GROUP.name)
        if failure is not None:
            self._teardown(meta)
        return failure

    def _teardown(self, meta: WeightUpdateMeta) -> None:
        if (self.group is not None or self._store is not None) and self._members:
            # Servers that never joined (or died) have nothing to leave: their "no group" is fine.
            with contextlib.suppress(Exception):
                call(self.fleet, ops.LEAVE_GROUP, ops.LeaveGroup(meta.group_name), self._members)
        if self.group is not None:
            self._retire(self.group)
        self.group, self._store = None, None

    def _retire(self, group: WeightGroup) -> None:
        """Destroy `group` once no broadcast of ours runs on it. One still running (past its
        deadline, or blocked on a member given up at its eviction) is not waited for: it ends at
        the group's own timeout, then the group goes; a fresh thread takes the next broadcasts."""
        stuck = [f for f in self._stuck if not f.done()]
        self._stuck.clear()
        if not stuck:
            group.destroy()
            return
        left = [len(stuck)]

        def one_done(_: Future) -> None:
            left[0] -= 1
            if left[0] == 0:
                group.destroy()

        for fut in stuck:
            fut.add_done_callback(one_done)
        self._pool.shutdown(wait=False)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="tandem-weights")

    # -- buckets (rank 0) ------------------------------------------------------------------------------
    def begin(self, meta: WeightUpdateMeta, wire_dtype: torch.dtype | None) -> None:
        self._flat = self.fleet.capabilities.flat_buckets  # read once an update, not per bucket

    def _device(self, meta: WeightUpdateMeta, device: torch.device) -> torch.device:
        return torch.device("cpu") if meta.backend == "gloo" else device

    def reserve(self, meta: WeightUpdateMeta, k: int, names: list[str], shapes: list[torch.Size],
                dtype: torch.dtype, device: torch.device) -> Packed | None:
        if self._device(meta, device) != device:
            return None  # gloo from a GPU: the export allocates, `pack` copies to the CPU
        return self._place(k, names, shapes, [dtype] * len(names), device)

    def _place(self, k: int, names: Sequence[str], shapes: Sequence[torch.Size], dtypes: Sequence[torch.dtype],
               device: torch.device) -> Packed:
        """Where the bucket goes in flat buffer k % 2 (offsets, views; nothing copied)."""
        shells = [torch.empty(s, dtype=d, device="meta") for s, d in zip(shapes, dtypes, strict=True)]
        offsets, nbytes = layout(shells)
        buf = self._buffers.get(k % 2 if self.options.pipeline else 0, nbytes, device)
        views = tensor_views(buf, offsets, shapes, dtypes)
        return Packed(list(names), specs_of(names, shapes, dtypes), offsets, nbytes, views, flat=buf)

    def pack(self, meta: WeightUpdateMeta, k: int, bucket: Bucket, wire_dtype: torch.dtype | None) -> Packed:
        tensors = [t.detach() if t.requires_grad else t for _, t in bucket]  # exports are detached already
        packed = self._place(k, [n for n, _ in bucket], [t.shape for t in tensors],
                             [wire_dtype or t.dtype for t in tensors], self._device(meta, tensors[0].device))
        for view, t in zip(packed.views, tensors, strict=True):
            view.copy_(t)  # the cast writes straight into the send buffer
        return packed

    def send(self, meta: WeightUpdateMeta, k: int, packed: Packed, clock: Clock,
             report: UpdateReport) -> WeightSyncError | None:
        if self._in_flight is not None:  # pipelined: bucket k was packed while k - 1 was in flight
            with timed(report, "wait"):
                failure = self._settle(report)
            if failure is not None:
                return failure
        flat = ops.FlatLayout(tuple(packed.offsets), packed.nbytes) if self._flat else None
        if self.fleet.capabilities.staged_commit:
            request = ops.DistributedBucket(meta.group_name, packed.specs, bucket_index=k, commit=False, flat=flat,
                                            lora_alpha=meta.lora_alpha)
        else:  # SGLang's semantics: each bucket is applied on arrival (a partial set, no version)
            request = ops.DistributedBucket(meta.group_name, packed.specs, flat=flat, lora_alpha=meta.lora_alpha)
        fleet_future = self.fleet.send(ops.STAGE_DISTRIBUTED, request)
        sends = [packed.flat] if self._flat else packed.tensor_views()
        local = self._pool.submit(broadcast_all, self.group, sends, meta.deadlines.bucket_s)
        deadline = time.monotonic() + clock.left(meta.deadlines.bucket_s)
        self._in_flight = InFlight(f"stage_distributed (bucket {k})", fleet_future, local, deadline)
        if not self.options.pipeline:
            with timed(report, "wait"):
                return self._settle(report)
        return None

    def flush(self, meta: WeightUpdateMeta, clock: Clock, report: UpdateReport, send: bool) -> WeightSyncError | None:
        if self._in_flight is None:
            return None
        with timed(report, "wait"):
            return self._settle(report)

    def _settle(self, report: UpdateReport) -> WeightSyncError | None:
        item, self._in_flight = self._in_flight, None
        return item.settle(report, self._stuck)

    # -- outcome -----------------------------------------------------------------------------------------
    def committed(self, meta: WeightUpdateMeta) -> None:
        if not self.options.keep_group:
            self._teardown(meta)

    def rollback(self, meta: WeightUpdateMeta) -> None:
        self._teardown(meta)

    def close(self) -> None:
        if self.rank != 0:
            return
        if self.group is not None and self._meta is not None:
            self._teardown(self._meta)
        self._pool.shutdown(wait=True)
        self._buffers.clear()

"""The trainer side of a weight update: every trainer rank calls it after a training step.

    updater = WeightUpdater(engine, fleet if rank == 0 else None, meta)   # on every rank
    report = updater.update(version)                                       # on every rank
    updater.close()                                                        # on every rank

`engine` is anything with `export_weights(bucket_bytes, dtype)` (buckets of `(hf_name, full
tensor)`, a collective) and `save_hf(out_dir, overwrite=...)` (a collective), e.g. `TrainEngine`.
Only rank 0 talks to the fleet; every rank joins the gathers, in the same order.

One update, on rank 0: pause generation; transfer (staged on the servers, nothing swapped yet);
commit everywhere (weights and version change together); optionally verify checksums; set the
version; continue generation. Any failure (a server error, a deadline, a broken group) discards
what the servers staged, tears the transfer group down (the next update forms a fresh one), and
continues generation on the previous weights. Rank 0 then broadcasts the outcome over the
trainer's own process group, so every rank returns or raises `WeightSyncError` together.

Transports (`meta.type`):
- disk: every rank joins `save_hf` into `meta.versioned_path()` (written under a temporary name,
  renamed when complete); servers stage it concurrently; after every server committed version N,
  older versions are deleted (N stays).
- distributed: rank 0 hosts a store, forms the group with the servers (its rank 0, server i at
  1 + i) and, per bucket, sends the HTTP announcement and the broadcast concurrently. Each bucket
  is cast straight into one of two flat send buffers kept between updates and goes out as ONE
  broadcast (`FlatLayout`: offsets in the announcement), when the fleet supports it (HttpFleet,
  RolloutCallback);
  otherwise one broadcast per tensor (views of the same buffer). Pipelined (default): bucket k + 1
  is gathered/cast while bucket k is broadcast, its request issued when k is acknowledged; at most
  one bucket in flight. Serial: gather, send, wait, next.
- shm: rank 0 casts the buckets back to back into one /dev/shm segment, which the servers map
  and, at commit, serve from (zero-copy: two sets of segments written in turn, never the one being
  served). One announcement in flight; the trainer does not wait for it between buckets, and what
  it cast meanwhile goes out together in the next (`_ShmAnnouncements`). Segments are kept
  between updates (`shm_reuse=True`, the default) and unlinked at `close`, after a failure, or (a
  dead trainer's) by the next updater; with `shm_reuse=False` every segment is unlinked when the
  update ends, committed or not (servers keep serving from their mappings).

This module is the orchestration (fleet calls, deadlines, the pipeline, rollback, the outcome);
which tensors form a bucket and how a bucket becomes bytes on the wire is `packing.py`.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import dataclasses
import re
import shutil
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from tandem.errors import TandemError
from tandem.weights.fleet import Fleet, FleetError, ServerResult
from tandem.weights.group import WeightGroup, WeightGroupError, host_store, init_weight_group
from tandem.weights.meta import FlatLayout, WeightUpdateMeta
from tandem.weights.packing import (
    Packed,
    SendBuffers,
    broadcast_all,
    expected_bytes,
    export_buckets,
    lives_in,
    merge_packed,
)
from tandem.weights.packing import plan_buckets as _plan_buckets  # noqa: F401  (its old name, for tests)
from tandem.weights.report import Clock, UpdateReport, timed
from tandem.weights.shm import remove_stale_segments
from tandem.weights.verify import UpdateVerifier

_VERSION_DIR = re.compile(r"^v(\d{8,})$")


class WeightSyncError(TandemError, RuntimeError):
    """A weight update failed; `phase` says where, `failures` which servers said what."""

    def __init__(self, message: str, phase: str = "", failures: Sequence[ServerResult] = ()):
        super().__init__(message)
        self.phase, self.failures = phase, tuple(failures)

    @classmethod
    def from_fleet(cls, exc: FleetError) -> WeightSyncError:
        return cls(str(exc), exc.phase, exc.failures)


@dataclass
class _InFlight:
    """One bucket on its way: the servers' acknowledgement and the trainer's own part."""

    phase: str
    fleet_future: Future | None
    local_future: Future | None
    deadline: float


@dataclass
class _ShmAnnouncements:
    """shm buckets packed but not yet announced (in order), and the announcement in flight."""

    pending: list[Packed] = field(default_factory=list)
    in_flight: _InFlight | None = None
    sent: int = 0  # announcements so far: the servers' bucket index of the next one

    def take_window(self) -> Packed:
        """The leading pending buckets that lie in one segment, as one bucket (a CUDA IPC bucket
        goes alone: each has its own buffer)."""
        first = self.pending[0]
        count = 1
        if first.shm.segment is not None:
            while count < len(self.pending) and self.pending[count].shm.segment == first.shm.segment:
                count += 1
        group, self.pending = self.pending[:count], self.pending[count:]
        return first if count == 1 else merge_packed(group)


class WeightUpdater:
    def __init__(self, engine: Any, fleet: Fleet | None, meta: WeightUpdateMeta, *, pipeline: bool = True,
                 verify: bool = False, dtype: torch.dtype | None = None, keep_group: bool = True,
                 shm_reuse: bool = True):
        self.engine, self.fleet, self.meta = engine, fleet, meta
        self.pipeline, self.verify, self.dtype, self.keep_group = pipeline, verify, dtype, keep_group
        # shm: keep the segments between updates (unlinked by `close` or on a failure) instead of
        # unlinking them after each update; fresh tmpfs pages cost far more than the copy itself.
        self.shm_reuse = shm_reuse
        if dist.is_initialized():
            self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        else:
            self.rank, self.world_size = 0, 1
        if self.rank == 0 and fleet is None:
            raise ValueError("trainer rank 0 needs the fleet")
        self._group: WeightGroup | None = None
        self._store: Any = None
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="tandem-weights") if self.rank == 0 else None
        self._stuck: list[Future] = []  # trainer-side work that outlived its deadline
        self._buffers = SendBuffers()  # flat send buffers (kept between updates), shm segments
        self._verifier = UpdateVerifier(fleet) if self.rank == 0 else None
        if self.rank == 0 and meta.type == "shm":
            remove_stale_segments()

    # ------------------------------------------------------------------ the update
    def update(self, version: int) -> UpdateReport:
        """Move the engine's current weights to every server as `version`. Collective."""
        meta = self.meta.for_version(version)
        clock = Clock(meta.deadlines.update_s)
        report = UpdateReport(version, meta.type)
        start = time.perf_counter()
        rank0 = self.rank == 0
        state = {"paused": False}
        try:
            failure = self._run(meta, clock, report, state)
        except BaseException as exc:  # a local error (export, save): still leave the fleet serving
            if rank0:
                self._rollback(meta, WeightSyncError(str(exc), "trainer"))
                if state["paused"]:
                    self._call("continue_generation", self.fleet.continue_generation)
            raise
        report.seconds = time.perf_counter() - start
        self._agree(failure, meta)
        return report

    __call__ = update

    def _run(self, meta: WeightUpdateMeta, clock: Clock, report: UpdateReport,
             state: dict[str, bool]) -> WeightSyncError | None:
        rank0 = self.rank == 0
        failure: WeightSyncError | None = None
        if meta.type == "disk":
            with timed(report, "save"):
                saved = Path(self.engine.save_hf(meta.versioned_path(), overwrite=True))
            report.bytes = sum(f.stat().st_size for f in saved.glob("*.safetensors"))
        if rank0:
            failure = self._call("pause_generation", self.fleet.pause_generation)
            state["paused"] = failure is None
            if failure is None and self.verify:
                failure = self._call("verify", self._verifier.prepare)
            if failure is None and meta.type == "distributed" and self._group is None:
                with timed(report, "init_group"):
                    failure = self._form_group(meta, clock)
        if meta.type in ("distributed", "shm"):
            with timed(report, "transfer"):
                failure = self._stream(meta, clock, report, failure)
        if rank0:
            if failure is None and meta.type == "disk":
                with timed(report, "load"):
                    failure = self._wait(self.fleet.update_weights_from_disk(meta, commit=False),
                                         "update_weights_from_disk", clock.left())
                    if failure is None and self.verify:
                        self._verifier.add_checkpoint(meta.versioned_path())
            if failure is None:
                with timed(report, "commit"):
                    failure = self._call("commit_staged_weights", lambda: self.fleet.commit_weights(meta))
            if failure is None and self.verify:
                with timed(report, "verify"):
                    failure = self._call("verify", self._verifier.check)
                    report.verified = failure is None
            if failure is None:
                failure = self._call("update_weight_version", lambda: self.fleet.set_version(meta.version))
            if failure is not None:
                self._rollback(meta, failure)
            else:
                self._after_success(meta)
            if state["paused"]:  # always: the servers must go on, on whichever weights they hold now
                state["paused"] = False
                resumed = self._call("continue_generation", self.fleet.continue_generation)
                failure = failure or resumed
        return failure

    # ------------------------------------------------------------------ streaming (all ranks)
    def _stream(self, meta: WeightUpdateMeta, clock: Clock, report: UpdateReport,
                failure: WeightSyncError | None) -> WeightSyncError | None:
        """Iterate the export on every rank; rank 0 packs each bucket (cast straight into a reused
        flat buffer or the bucket's shm segment) and sends it while nothing failed (the gathers
        must run to the end on every rank either way).

        Pipelined: bucket k is packed into one of two flat buffers while bucket k - 1 (in the
        other) is broadcast by the worker thread; k is sent once k - 1 is acknowledged."""
        rank0 = self.rank == 0
        k = -1
        reserved: list[Packed | None] = [None]

        def alloc(names, shapes, dtype, device):  # the export's bucket k + 1 goes straight to its send memory
            if not rank0 or failure is not None or (self.dtype is not None and dtype != self.dtype):
                return None
            try:
                reserved[0] = self._buffers.reserve(meta, (k + 1) % 2 if self.pipeline else 0, names, shapes,
                                                    dtype, device)
            except Exception:  # e.g. /dev/shm full: raised again by `pack`, which fails the update
                return None  # (raising here would leave the other ranks in the next gather)
            return None if reserved[0] is None else reserved[0].views

        wire_dtype, buckets = export_buckets(self.engine, self.world_size, self.dtype, meta.bucket_bytes, alloc)
        if rank0 and meta.type == "shm":
            self._buffers.rewind_shm(expected_bytes(self.engine, wire_dtype))
        shm = _ShmAnnouncements() if meta.type == "shm" else None
        in_flight: _InFlight | None = None
        while True:
            reserved[0] = None
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
                    if reserved[0] is not None and lives_in(bucket, reserved[0]):
                        packed = reserved[0]  # gathered straight into its send memory
                        report.in_place += 1
                    else:
                        packed = self._buffers.pack(meta, k % 2 if self.pipeline else 0, bucket, wire_dtype)
            except Exception as exc:  # e.g. /dev/shm full: fail the update, keep iterating the gathers
                phase = f"update_weights_from_{meta.type} (bucket {k})"
                failure = WeightSyncError(f"{phase}: the trainer could not pack the bucket: "
                                          f"{type(exc).__name__}: {exc}", phase)
                if in_flight is not None:  # reap k - 1 before anything is torn down
                    self._settle(in_flight, clock, report)
                    in_flight = None
                if shm is not None:
                    self._drain_shm(meta, shm, clock, report, send=False)
                continue
            del bucket
            if self.verify:
                self._verifier.add(list(zip(packed.names, packed.views, strict=True)))
            packed.views = []  # shm: no exported view of a segment may outlive the write
            if shm is not None:
                shm.pending.append(packed)
                failure = (self._announce_shm(meta, shm, clock, report, wait=False) if self.pipeline
                           else self._drain_shm(meta, shm, clock, report))
                continue
            if in_flight is not None:  # pipelined: bucket k was packed while k - 1 was in flight
                with timed(report, "wait"):
                    failure = self._settle(in_flight, clock, report)
                in_flight = None
                if failure is not None:
                    continue
            in_flight = self._send(meta, k, packed, clock)
            if not self.pipeline:
                with timed(report, "wait"):
                    failure = self._settle(in_flight, clock, report)
                in_flight = None
        if in_flight is not None:
            with timed(report, "wait"):
                failure = self._settle(in_flight, clock, report)
        if shm is not None:
            failure = self._drain_shm(meta, shm, clock, report, send=failure is None) or failure
        if rank0 and failure is None and report.buckets == 0:
            failure = WeightSyncError("the engine exported no weights", "export")
        return failure

    def _announce_shm(self, meta: WeightUpdateMeta, shm: _ShmAnnouncements, clock: Clock, report: UpdateReport,
                      *, wait: bool) -> WeightSyncError | None:
        """shm: settle the announcement in flight (waiting for it only when `wait`; otherwise only
        if it is done) and announce what is pending. At most one announcement is in flight, so
        whatever is packed meanwhile goes out together in the next one (its window of the
        segment): the trainer never waits on a server between buckets, and a fast cast of many
        small buckets costs few round trips."""
        if shm.in_flight is not None:
            if not wait and not shm.in_flight.fleet_future.done():
                return None
            with timed(report, "wait"):
                failure = self._settle(shm.in_flight, clock, report)
            shm.in_flight = None
            if failure is not None:
                shm.pending.clear()
                return failure
        if shm.pending:
            shm.in_flight = self._send(meta, shm.sent, shm.take_window(), clock)
            shm.sent += 1
        return None

    def _drain_shm(self, meta: WeightUpdateMeta, shm: _ShmAnnouncements, clock: Clock, report: UpdateReport,
                   send: bool = True) -> WeightSyncError | None:
        """Announce everything pending and wait for all of it (`send=False`: only settle the
        announcement in flight, e.g. after a failure)."""
        if not send:
            shm.pending.clear()
        while shm.in_flight is not None or shm.pending:
            failure = self._announce_shm(meta, shm, clock, report, wait=True)
            if failure is not None:
                return failure
        return None

    def _send(self, meta: WeightUpdateMeta, k: int, packed: Packed, clock: Clock) -> _InFlight:
        deadline = time.monotonic() + clock.left(meta.deadlines.bucket_s)
        if meta.type == "distributed":
            timeout = meta.deadlines.bucket_s
            if getattr(self.fleet, "supports_flat_buckets", False):  # one broadcast for the bucket
                flat = FlatLayout(tuple(packed.offsets), packed.nbytes)
                fleet_future = self.fleet.update_weights_from_distributed(meta, packed.specs, commit=False,
                                                                          bucket_index=k, flat=flat)
                sends = [packed.flat]
            else:  # a fleet that only knows the SGLang protocol: one broadcast per tensor (views)
                fleet_future = self.fleet.update_weights_from_distributed(meta, packed.specs, commit=False,
                                                                          bucket_index=k)
                sends = packed.tensor_views()
            local = self._pool.submit(broadcast_all, self._group, sends, timeout)
            return _InFlight(f"update_weights_from_distributed (bucket {k})", fleet_future, local, deadline)
        fleet_future = self.fleet.update_weights_from_shm(meta, packed.shm, commit=False, bucket_index=k)
        return _InFlight(f"update_weights_from_shm (bucket {k})", fleet_future, None, deadline)

    def _settle(self, item: _InFlight, clock: Clock, report: UpdateReport | None = None) -> WeightSyncError | None:
        """Wait for one bucket (both halves) up to its deadline; -> the failure, if any."""
        problems: list[WeightSyncError] = []
        fleet_future = item.fleet_future
        if item.local_future is not None:
            local = item.local_future
            try:
                seconds = local.result(timeout=max(0.0, item.deadline - time.monotonic()))
                if report is not None:  # the worker's broadcast time (overlaps the next pack)
                    report.phases["broadcast"] = report.phases.get("broadcast", 0.0) + seconds
            except cf.TimeoutError:
                self._stuck.append(local)
                problems.append(WeightSyncError(f"{item.phase}: the trainer's side did not finish within the "
                                                "bucket deadline", item.phase))
            except Exception as exc:
                problems.append(WeightSyncError(f"{item.phase}: trainer side failed: {exc}", item.phase))
        if fleet_future is not None:
            failure = self._wait(fleet_future, item.phase, max(0.0, item.deadline - time.monotonic()) + 1.0)
            if failure is not None:
                problems.insert(0, failure)  # the servers' own words name who failed
        return problems[0] if problems else None

    # ------------------------------------------------------------------ group lifecycle (rank 0)
    def _form_group(self, meta: WeightUpdateMeta, clock: Clock) -> WeightSyncError | None:
        timeout = clock.left(meta.deadlines.init_group_s)
        try:
            self._store = host_store(meta.master_address, meta.master_port, timeout_s=max(timeout, 1.0))
        except Exception as exc:
            return WeightSyncError(f"cannot host the weight group's store on {meta.master_address}:"
                                   f"{meta.master_port}: {exc}", "init_weights_update_group")
        formed = dataclasses.replace(meta, master_port=self._store.port)
        future = self.fleet.init_weights_update_group(formed)
        local_error = None
        try:
            self._group = init_weight_group(meta.master_address, self._store.port, 0, 1 + self.fleet.world_size,
                                            meta.group_name, meta.backend, timeout_s=max(timeout, 1.0),
                                            store=self._store)
        except WeightGroupError as exc:
            local_error = exc
        failure = self._wait(future, "init_weights_update_group", clock.left(meta.deadlines.init_group_s) + 1.0)
        if failure is None and local_error is not None:
            failure = WeightSyncError(f"init_weights_update_group: the trainer could not form the group: "
                                      f"{local_error}", "init_weights_update_group")
        if failure is not None:
            self._teardown_group(meta)
        return failure

    def _teardown_group(self, meta: WeightUpdateMeta) -> None:
        self._drain_stuck()
        if self._group is not None or self._store is not None:
            # Servers that never joined (or died) have nothing to leave: their "no group" is fine.
            with contextlib.suppress(Exception):
                self.fleet.destroy_weights_update_group(meta)
        if self._group is not None:
            self._group.destroy()
        self._group, self._store = None, None

    def _drain_stuck(self) -> None:
        """Wait for trainer-side work past its deadline: gloo ops carry the bucket timeout, so this
        ends; a group must not be torn down under a running collective."""
        for fut in self._stuck:
            with contextlib.suppress(Exception):
                fut.result(timeout=self.meta.deadlines.bucket_s + 5)
        self._stuck.clear()

    # ------------------------------------------------------------------ outcome (rank 0)
    def _rollback(self, meta: WeightUpdateMeta, failure: WeightSyncError) -> None:
        self._call("discard_staged_weights", lambda: self.fleet.discard_weights(meta))
        if meta.type == "distributed":
            self._teardown_group(meta)
        self._drain_stuck()
        self._buffers.release_shm()
        if meta.type == "disk":
            shutil.rmtree(meta.versioned_path(), ignore_errors=True)

    def _after_success(self, meta: WeightUpdateMeta) -> None:
        if meta.type == "shm":
            self._buffers.shm_committed()
        if not self.shm_reuse:
            self._buffers.release_shm()
        if meta.type == "distributed" and not self.keep_group:
            self._teardown_group(meta)
        if meta.type == "disk":  # every server acknowledged `version`: older copies can go
            for path in Path(meta.path).iterdir():
                m = _VERSION_DIR.match(path.name)
                if m and int(m.group(1)) < meta.version and path.is_dir():
                    shutil.rmtree(path, ignore_errors=True)

    def _agree(self, failure: WeightSyncError | None, meta: WeightUpdateMeta) -> None:
        """Rank 0's outcome becomes every rank's (raised everywhere or nowhere)."""
        if self.world_size > 1:
            payload = [None if failure is None else (str(failure), failure.phase)]
            dist.broadcast_object_list(payload, src=0)
            if payload[0] is not None and failure is None:
                failure = WeightSyncError(payload[0][0], payload[0][1])
        if failure is not None:
            raise failure

    # ------------------------------------------------------------------ helpers
    def _call(self, phase: str, fn: Callable[[], Any]) -> WeightSyncError | None:
        try:
            fn()
        except FleetError as exc:
            return WeightSyncError.from_fleet(exc)
        except Exception as exc:  # a fleet that is not HTTP may raise anything
            return WeightSyncError(f"weight update phase {phase!r} failed: {type(exc).__name__}: {exc}", phase)
        return None

    def _wait(self, future: Future, phase: str, timeout: float) -> WeightSyncError | None:
        try:
            future.result(timeout=timeout)
        except FleetError as exc:
            return WeightSyncError.from_fleet(exc)
        except cf.TimeoutError:
            return WeightSyncError(f"weight update phase {phase!r}: no answer from the fleet within {timeout:.1f}s",
                                   phase)
        except Exception as exc:
            return WeightSyncError(f"weight update phase {phase!r} failed: {type(exc).__name__}: {exc}", phase)
        return None

    def close(self) -> None:
        """Leave the transfer group and release resources. Call on every rank."""
        if self.rank == 0:
            if self._group is not None:
                self._teardown_group(self.meta)
            self._buffers.release_shm()
            if self._pool is not None:
                self._pool.shutdown(wait=True)
            self._buffers.clear()

    def __enter__(self) -> WeightUpdater:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def update_weights(engine: Any, fleet: Fleet | None, meta: WeightUpdateMeta, *, pipeline: bool = True,
                   verify: bool = False, dtype: torch.dtype | None = None) -> UpdateReport:
    """One update to `meta.version` with a transfer group formed for it and torn down after.
    Call on every trainer rank (fleet on rank 0). Keep a `WeightUpdater` to reuse the group."""
    with WeightUpdater(engine, fleet, meta, pipeline=pipeline, verify=verify, dtype=dtype,
                       keep_group=False) as updater:
        return updater.update(meta.version)

"""`WeightUpdater`: the trainer side of weight updates, on every trainer rank.

    updater = WeightUpdater(source, fleet if rank == 0 else None, meta)   # every rank
    report = updater.update(version)                                       # every rank, after a step
    updater.close()                                                        # every rank

Only rank 0 talks to the fleet; it plans the update (the fleet's `Topology`), warms joining
servers from a checkpoint, runs `two_phase.run_update` over a `FleetView` (retrying a failed
collective on the other servers within the deadline) and admits the warmed ones. Each decision is
broadcast over the trainer's process group before any rank acts on it, so every rank runs the same
collectives and returns the `UpdateReport` or raises `WeightSyncError` together. See
docs/weight-sync.md and docs/fleet.md, "Elastic membership"."""

from __future__ import annotations

import contextlib
import logging
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from tandem.fleet import ops
from tandem.fleet.interface import Fleet, call
from tandem.fleet.results import FleetError
from tandem.fleet.view import FleetView, blamed
from tandem.weights.calls import fleet_call
from tandem.weights.meta import WeightUpdateMeta
from tandem.weights.report import Clock, UpdateReport, WeightSyncError, timed
from tandem.weights.source import WeightSource
from tandem.weights.transports import TransportOptions, make_transport
from tandem.weights.two_phase import run_update
from tandem.weights.verify import UpdateVerifier

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Plan:
    """Rank 0's decision for the next step of an update, as every rank receives it."""

    targets: tuple[str, ...] = ()  # the servers of the next attempt (empty: no further attempt)
    warm: bool = False  # every rank joins the warm-up checkpoint's save first
    elastic: bool = False  # the update may go on without servers that fail (`Topology.elastic`)


class WeightUpdater:
    def __init__(self, source: WeightSource, fleet: Fleet | None, meta: WeightUpdateMeta, *, pipeline: bool = True,
                 verify: bool = False, dtype: torch.dtype | None = None, keep_group: bool = True,
                 shm_reuse: bool = True):
        self.meta = meta
        self.source = source
        if dist.is_initialized():
            self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        else:
            self.rank, self.world_size = 0, 1
        if self.rank == 0:
            if fleet is None:
                raise ValueError("trainer rank 0 needs the fleet")
            lacking = fleet.capabilities.missing_for(meta.type)
            if lacking is not None:
                raise WeightSyncError(f"weight_sync={meta.type!r} needs {lacking}, which these servers do not "
                                      "offer; use servers that do (tandem serve) or another train.weight_sync",
                                      "capabilities")
            if meta.lora_alpha is not None and meta.type not in fleet.capabilities.adapter_updates:
                raise WeightSyncError(f"LoRA adapter updates over weight_sync={meta.type!r} need servers that take "
                                      "adapters over it (tandem serve; vLLM in LoRA mode from disk); these take whole "
                                      "weights: send merged weights (WeightUpdateMeta.lora_alpha=None)", "capabilities")
        self.fleet = fleet
        self.verify = verify and self.rank == 0
        options = TransportOptions(pipeline=pipeline, dtype=dtype, keep_group=keep_group, shm_reuse=shm_reuse)
        self.transport = make_transport(meta, source, fleet, self.rank, self.world_size, options)
        self._warned_no_warmup = False
        self._warming: tuple[str, ...] = ()  # rank 0: the joiners this update warms
        self._plan_error = ""  # rank 0: why the plan has no targets, when the topology was unreadable
        self._devices: dict[str, int] = {}  # rank 0: the planned servers' devices, where more than one

    def update(self, version: int) -> UpdateReport:
        """Move the source's current weights to the fleet's members (and warmed joiners) as
        `version`. Collective."""
        meta = self.meta.for_version(version)
        report = UpdateReport(version, meta.type)
        start = time.perf_counter()
        clock = Clock(meta.deadlines.update_s)
        plan = self._share(self._plan(meta) if self.rank == 0 else None)
        warmed: tuple[str, ...] = ()
        if plan.warm:
            warmed = self._warm_up(meta, clock, report)
        targets = (*plan.targets, *warmed)
        failure: WeightSyncError | None = None
        view: FleetView | None = None
        if not plan.targets and not plan.warm:  # no server at all (every rank knows): only the version moves
            if self.rank == 0:
                failure = self._no_servers(version)
            report.seconds = time.perf_counter() - start
            self._agree(failure, report)
            return report
        while True:
            report.attempts += 1
            if self.rank == 0:
                view = FleetView(self.fleet, targets, shrink=plan.elastic, devices=self._devices)
                self.transport.retarget(view)
                # With no target the attempt still runs: the other ranks are in the export's collectives.
                failure = run_update(meta, self.transport, view, self.rank, self._verifier(view), report, clock)
                if not targets:  # the joiners all failed their warm-up, and there is no member
                    failure = self._no_servers(version)
            else:
                run_update(meta, self.transport, None, self.rank, None, report, clock)
            following = self._share(self._next_attempt(meta, failure, targets, view, clock, warmed)
                                     if self.rank == 0 else None)
            if view is not None:
                report.left_out.update(view.dropped)
            if not following.targets:
                break
            targets, plan = following.targets, following
        if self.rank == 0 and failure is not None and plan.elastic and not self._members_left(targets):
            failure = self._no_servers(version)  # every target failed and was evicted: none to update
            view.targets.clear()
        if self.rank == 0 and view is not None:
            report.servers = tuple(view.targets)
            report.warmed = tuple(a for a in warmed if a in view.targets)
            if failure is None and report.warmed:
                failure = _admit(self.fleet, report.warmed, version)
        report.seconds = time.perf_counter() - start
        self._agree(failure, report)
        return report

    # -- decisions (rank 0) ------------------------------------------------------------------------
    def _plan(self, meta: WeightUpdateMeta) -> _Plan:
        self._plan_error, self._warming = "", ()
        try:
            topology = self.fleet.topology()
        except FleetError as exc:  # never raise here: the other ranks wait for this plan
            self._plan_error = f"cannot read the fleet's topology: {exc}"
            return _Plan()
        warm = bool(topology.warming)
        if warm and not meta.warmup_dir:
            if not self._warned_no_warmup:
                logger.warning("servers wait to join (%s) but this update has no warm-up directory",
                               ", ".join(topology.warming))
                self._warned_no_warmup = True
            warm = False
        self._warming = topology.warming if warm else ()
        self._devices = dict(topology.devices)
        return _Plan(topology.members, warm, topology.elastic)

    def _next_attempt(self, meta: WeightUpdateMeta, failure: WeightSyncError | None, targets: tuple[str, ...],
                      view: FleetView | None, clock: Clock, warmed: tuple[str, ...]) -> _Plan:
        """After a failed attempt on `targets`: the servers to try again without the ones to
        blame, if any remain, the fleet still counts them as members, and time is left."""
        if failure is None or view is None or not view.shrink or clock.left() <= 1.0:
            return _Plan()
        culprits = blamed(failure.failures, targets)
        if not culprits:
            return _Plan()
        try:
            current = set(self.fleet.topology().members) | set(warmed)
        except FleetError:
            current = set(view.targets)
        survivors = tuple(a for a in view.targets if a not in culprits and a in current)
        if survivors:
            logger.warning("weight update to version %d: %s failed on %s; trying again on %d other server(s)",
                           meta.version, failure.phase, ", ".join(culprits), len(survivors))
            for address in culprits:
                view.dropped[address] = str(failure)
        return _Plan(survivors, elastic=True)

    def _members_left(self, targets: tuple[str, ...]) -> bool:
        try:
            return bool(set(targets) & set(self.fleet.topology().members))
        except FleetError:
            return True  # cannot tell: keep the failure

    def _no_servers(self, version: int) -> WeightSyncError | None:
        """No server to update: the fleet's version still moves (servers that join later are warmed
        to it), unless the fleet could not even be asked."""
        if self._plan_error:
            return WeightSyncError(self._plan_error, "plan")
        logger.warning("weight update to version %d: no server is in the fleet; only the version moves", version)
        return fleet_call(self.fleet, ops.SET_VERSION, ops.SetVersion(version))

    def _verifier(self, view: FleetView) -> UpdateVerifier | None:
        return UpdateVerifier(view) if self.verify else None

    # -- warm-up ---------------------------------------------------------------------------------------
    def _warm_up(self, meta: WeightUpdateMeta, clock: Clock, report: UpdateReport) -> tuple[str, ...]:
        """Every rank: save the weights for the joiners; rank 0: load them there, commit, compare
        checksums. -> the joiners that hold `meta.version` (rank 0; others: ())."""
        path = meta.warmup_path()
        with timed(report, "warmup"):
            self.source.save_hf(path, overwrite=True)
            if self.rank != 0:
                return ()
            try:
                return self._load_into_joiners(meta, path)
            finally:
                shutil.rmtree(path, ignore_errors=True)

    def _load_into_joiners(self, meta: WeightUpdateMeta, path: Path) -> tuple[str, ...]:
        """Load `path` (whole weights, or the adapter where updates carry adapters) into the
        joiners, as far as their capabilities go: staged state discarded, the version set with the
        load, checksums compared. Servers without them (vLLM) get the version from this update's
        `set_version`, which reaches the warmed joiners with the members."""
        view = FleetView(self.fleet, self._warming)
        capabilities = self.fleet.capabilities
        if capabilities.distributed_update:
            with contextlib.suppress(FleetError):  # a revived server may still hold a stale group
                call(view, ops.LEAVE_GROUP, ops.LeaveGroup(meta.group_name))
        try:
            if capabilities.staged_commit:
                call(view, ops.DISCARD, ops.DiscardStaged())
            version = meta.version if capabilities.commit_sets_version else None
            call(view, ops.LOAD_DISK, ops.DiskLoad(str(path), commit=True, version=version,
                                                   adapter=meta.lora_alpha is not None))
            if capabilities.checksums:
                verifier = UpdateVerifier(view)
                verifier.prepare()
                verifier.add_checkpoint(path)
                try:
                    verifier.check()
                except FleetError as exc:  # drop the ones that differ; the others are warm
                    for failure in exc.failures:
                        view.drop(failure.address, f"warm-up: {failure.message}")
        except FleetError as exc:
            logger.warning("warming %s failed: %s", ", ".join(self._warming), exc)
            return ()
        for address, why in view.dropped.items():
            logger.warning("%s was not warmed: %s", address, why)
        logger.info("warmed %s to version %d from %s", ", ".join(view.targets), meta.version, path)
        return tuple(view.targets)

    # -- agreement ------------------------------------------------------------------------------------
    def _share(self, plan: _Plan | None) -> _Plan:
        """Rank 0's plan, on every rank."""
        if self.world_size == 1:
            assert plan is not None
            return plan
        payload = [plan]
        dist.broadcast_object_list(payload, src=0)
        return payload[0]

    def _agree(self, failure: WeightSyncError | None, report: UpdateReport) -> None:
        """Rank 0's outcome becomes every rank's (raised everywhere or nowhere), with the servers
        it reached and left out."""
        if self.world_size > 1:
            outcome = None if failure is None else (str(failure), failure.phase)
            payload = [(outcome, report.servers, report.left_out, report.warmed)]
            dist.broadcast_object_list(payload, src=0)
            outcome, report.servers, report.left_out, report.warmed = payload[0]
            if outcome is not None and failure is None:
                failure = WeightSyncError(outcome[0], outcome[1])
        if failure is not None:
            raise failure

    def close(self) -> None:
        """Leave the transfer group and release buffers and segments. Call on every rank."""
        self.transport.close()

    def __enter__(self) -> WeightUpdater:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _admit(fleet: Fleet, addresses: tuple[str, ...], version: int) -> WeightSyncError | None:
    try:
        fleet.admit(addresses, version)
    except Exception as exc:
        return WeightSyncError(f"admitting {', '.join(addresses)} failed: {exc}", "admit")
    return None


def update_weights(source: WeightSource, fleet: Fleet | None, meta: WeightUpdateMeta, *, pipeline: bool = True,
                   verify: bool = False, dtype: torch.dtype | None = None) -> UpdateReport:
    """One update to `meta.version` with a transfer group formed for it and torn down after. Call
    on every trainer rank (fleet on rank 0). Keep a `WeightUpdater` to reuse the group."""
    with WeightUpdater(source, fleet, meta, pipeline=pipeline, verify=verify, dtype=dtype,
                       keep_group=False) as updater:
        return updater.update(meta.version)

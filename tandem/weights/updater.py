"""`WeightUpdater`: the trainer side of weight updates, on every trainer rank.

    updater = WeightUpdater(source, fleet if rank == 0 else None, meta)   # every rank
    report = updater.update(version)                                       # every rank, after a step
    updater.close()                                                        # every rank

Only rank 0 talks to the fleet; every rank joins the source's collectives in the same order. The
update itself is `tandem.weights.protocol.run_update` over the transport `meta.type` names; rank 0
then broadcasts the outcome over the trainer's own process group, so every rank returns the
`UpdateReport` or raises `WeightSyncError` together.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from tandem.fleet.protocol import Fleet
from tandem.weights.meta import WeightUpdateMeta
from tandem.weights.protocol import run_update
from tandem.weights.report import UpdateReport, WeightSyncError
from tandem.weights.source import WeightSource
from tandem.weights.transports import TransportOptions, make_transport
from tandem.weights.verify import UpdateVerifier


class WeightUpdater:
    def __init__(self, source: WeightSource, fleet: Fleet | None, meta: WeightUpdateMeta, *, pipeline: bool = True,
                 verify: bool = False, dtype: torch.dtype | None = None, keep_group: bool = True,
                 shm_reuse: bool = True):
        self.meta = meta
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
        self.fleet = fleet
        self.verifier = UpdateVerifier(fleet) if self.rank == 0 and verify else None
        options = TransportOptions(pipeline=pipeline, dtype=dtype, keep_group=keep_group, shm_reuse=shm_reuse)
        self.transport = make_transport(meta, source, fleet, self.rank, self.world_size, options)

    def update(self, version: int) -> UpdateReport:
        """Move the source's current weights to every server as `version`. Collective."""
        meta = self.meta.for_version(version)
        report = UpdateReport(version, meta.type)
        start = time.perf_counter()
        failure = run_update(meta, self.transport, self.fleet, self.rank, self.verifier, report)
        report.seconds = time.perf_counter() - start
        self._agree(failure)
        return report

    def _agree(self, failure: WeightSyncError | None) -> None:
        """Rank 0's outcome becomes every rank's (raised everywhere or nowhere)."""
        if self.world_size > 1:
            payload = [None if failure is None else (str(failure), failure.phase)]
            dist.broadcast_object_list(payload, src=0)
            if payload[0] is not None and failure is None:
                failure = WeightSyncError(payload[0][0], payload[0][1])
        if failure is not None:
            raise failure

    def close(self) -> None:
        """Leave the transfer group and release buffers and segments. Call on every rank."""
        self.transport.close()

    def __enter__(self) -> WeightUpdater:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def update_weights(source: WeightSource, fleet: Fleet | None, meta: WeightUpdateMeta, *, pipeline: bool = True,
                   verify: bool = False, dtype: torch.dtype | None = None) -> UpdateReport:
    """One update to `meta.version` with a transfer group formed for it and torn down after. Call
    on every trainer rank (fleet on rank 0). Keep a `WeightUpdater` to reuse the group."""
    with WeightUpdater(source, fleet, meta, pipeline=pipeline, verify=verify, dtype=dtype,
                       keep_group=False) as updater:
        return updater.update(meta.version)

"""One weight update, two-phase, over any `Transport`:

    rank 0:     pause -> [open] -> stage -> commit -> [verify -> version] -> continue
                (servers that abort at the commit, nothing verified:  [open] -> stage -> commit)
    all ranks:  prepare (disk: save)   stage (the export's collectives)

Where the servers stage while they generate (`Capabilities.stage_while_generating`), the pause is
sent first but waited for only before the commit: its round trip overlaps the transfer, and the
servers generate meanwhile; what matters is that they are paused when the weights swap. Where,
besides, nothing is checked after the commit and the servers abort their in-flight requests and
swap in the same step (`Capabilities.commit_aborts`), there is no pause at all: the commit does
what the pause and the continue did (`CommitStaged.abort_all`), two fan-outs less per update.

Nothing changes on a server until the commit, which swaps weights and version together (and,
with no verification after it, also announces the version: `CommitStaged.announce`); any
failure discards what was staged, lets the transport undo its part, and still continues generation
on the previous weights. Returns rank 0's failure (other ranks None; the caller agrees on the
outcome). Servers without `Capabilities.staged_commit` apply each bucket on arrival, so a failure
part way leaves them partly updated (the error says so). See docs/weight-sync.md, "One update"."""

from __future__ import annotations

from tandem.fleet import ops
from tandem.fleet.interface import Fleet
from tandem.weights.calls import failure_of, fleet_call, fleet_call_later
from tandem.weights.meta import WeightUpdateMeta
from tandem.weights.report import Clock, UpdateReport, WeightSyncError, timed
from tandem.weights.transports import Transport
from tandem.weights.verify import UpdateVerifier


def run_update(meta: WeightUpdateMeta, transport: Transport, fleet: Fleet | None, rank: int,
               verifier: UpdateVerifier | None, report: UpdateReport, clock: Clock | None = None) -> WeightSyncError | None:
    clock = clock or Clock(meta.deadlines.update_s)
    transport.prepare(meta, report)  # before the pause: generation goes on while a checkpoint is written
    if rank != 0:
        return transport.stage(meta, clock, report, None, None)
    assert fleet is not None, "trainer rank 0 needs the fleet"
    staged = fleet.capabilities.staged_commit
    # Nothing checked after the commit, and it sets the version: it announces the version too.
    announce = staged and verifier is None and fleet.capabilities.commit_sets_version
    unpaused = announce and fleet.capabilities.commit_aborts  # the commit aborts and swaps in one step
    pause = (lambda: None) if unpaused else fleet_call_later(fleet, ops.PAUSE, ops.PauseGeneration())
    early = staged and fleet.capabilities.stage_while_generating  # the pause is waited for at the commit
    failure = None if early else pause()

    def resume() -> WeightSyncError | None:
        """Continue the servers the pause stopped: after a failure too, they go on, on whichever
        weights they hold now."""
        return fleet_call(fleet, ops.CONTINUE, ops.ContinueGeneration()) if not unpaused and pause() is None else None

    try:
        if failure is None and verifier is not None:
            failure = failure_of("verify", verifier.prepare)
        if failure is None:
            failure = transport.open(meta, clock, report)
        with timed(report, "transfer"):
            failure = transport.stage(meta, clock, report, failure, verifier)
        if early:
            failure = failure or pause()
        if failure is None and staged:
            with timed(report, "commit"):
                failure = fleet_call(fleet, ops.COMMIT, ops.CommitStaged(meta.version, announce=announce,
                                                                         abort_all=unpaused))
        if failure is None and verifier is not None:
            with timed(report, "verify"):
                failure = failure_of("verify", verifier.check)
                report.verified = failure is None
        if failure is None and not announce:
            failure = fleet_call(fleet, ops.SET_VERSION, ops.SetVersion(meta.version))
    except BaseException:  # a local error (export, pack): still leave the fleet serving, then raise it
        _rollback(meta, transport, fleet, staged)
        resume()
        raise
    if failure is not None:
        _rollback(meta, transport, fleet, staged)
        if not staged:
            failure = WeightSyncError(f"{failure}; these servers apply each bucket on arrival (no staged commit), "
                                      "so they may hold part of this update: update them again", failure.phase,
                                      failure.failures)
    else:
        transport.committed(meta)
    resumed = resume()  # always, after a failure too
    return failure or resumed


def _rollback(meta: WeightUpdateMeta, transport: Transport, fleet: Fleet, staged: bool) -> None:
    if staged:
        fleet_call(fleet, ops.DISCARD, ops.DiscardStaged())
    transport.rollback(meta)


"""`ServerKeeper` at the end of a run, with real launched processes and a real membership: the
exit of a server the fleet already evicted is still reported (why it left), and the wait for it
is bounded."""

from __future__ import annotations

import logging
import os
import sys
import time
from pathlib import Path
from types import SimpleNamespace

from tandem.launch.process import ManagedProcess
from tandem.launch.scheduler import ServerHandle
from tandem.rl import keeper as keeper_module
from tandem.rl.keeper import ServerKeeper
from tandem.rollout.membership import Membership, MemberState

PORT = 9  # never contacted: the membership only keys on the address


def launched(tmp_path: Path, seconds: float) -> tuple[ManagedProcess, ServerHandle]:
    proc = ManagedProcess("rollout-1", [sys.executable, "-c", f"import time; time.sleep({seconds})"],
                          tmp_path / "rollout-1.log", os.environ)
    return proc, ServerHandle("rollout-1", "127.0.0.1", PORT, proc.pid, proc.log_path)


def keeper_for(proc: ManagedProcess, handle: ServerHandle) -> tuple[ServerKeeper, Membership]:
    membership = Membership([handle.url])
    controller = SimpleNamespace(fleet=SimpleNamespace(membership=membership, evict=membership.evict))
    keeper = ServerKeeper(SimpleNamespace(processes=[proc]), controller, [handle], model_path="unused",  # type: ignore[arg-type]
                          server_args=[], device="cpu", api_key=None, replace_dead=False)
    return keeper, membership


def test_a_server_evicted_before_its_launcher_saw_it_exit_is_still_reported(tmp_path, caplog):
    """Catches a run that ends between a failed call evicting a server (gone: unreachable) and its
    launcher process exiting (`srun` ends seconds after Slurm killed the job's server): the exit,
    and with it the reason the server left (the job CANCELLED), was dropped with the keeper."""
    proc, handle = launched(tmp_path, 2.0)
    keeper, membership = keeper_for(proc, handle)
    membership.evict(handle.url, "pause_generation failed: unreachable")
    began = time.monotonic()
    with caplog.at_level(logging.ERROR, logger="tandem.run"):
        keeper.close()
    took = time.monotonic() - began
    exits = [r.getMessage() for r in caplog.records if "exited" in r.getMessage()]
    assert exits and exits[0].startswith(f"rollout-1 ({handle.url}) exited ("), exits
    assert took < keeper_module.EXIT_REPORT_WAIT_S, took
    assert membership.record(handle.url).state is MemberState.EVICTED


def test_the_wait_for_an_evicted_server_that_never_exits_is_bounded(tmp_path, monkeypatch):
    """A server evicted for failed probes may still be running (hung): the run ends anyway."""
    monkeypatch.setattr(keeper_module, "EXIT_REPORT_WAIT_S", 1.0)
    proc, handle = launched(tmp_path, 120.0)
    try:
        keeper, membership = keeper_for(proc, handle)
        membership.evict(handle.url, "3 probes failed in a row")
        began = time.monotonic()
        keeper.close()
        assert 1.0 <= time.monotonic() - began < 30
    finally:
        proc.signal_group(9)
        proc.reap(10)


def test_a_replacement_is_probed_while_evicted_like_the_server_it_replaced(tmp_path):
    """Catches a replacement (`rollout.replace_dead`) joining as an outside server would: stopped
    (SIGSTOP) and evicted by its probes, it was never probed again, so after SIGCONT it never came
    back, though the run launched it and it still ran (found by bench/chaos.py)."""
    proc, handle = launched(tmp_path, 120.0)
    replacement = ServerHandle("rollout-1-r1", "127.0.0.1", PORT + 1, proc.pid, proc.log_path)
    membership = Membership([handle.url])
    controller = SimpleNamespace(
        fleet=SimpleNamespace(membership=membership, evict=membership.evict),
        join=lambda url, pid, **listed: membership.register(url, pid, **listed).state.value)
    scheduler = SimpleNamespace(processes=[proc], start_servers=lambda *args, **kwargs: [replacement])
    keeper = ServerKeeper(scheduler, controller, [handle], model_path="unused",  # type: ignore[arg-type]
                          server_args=[], device="cpu", api_key=None, replace_dead=True)
    try:
        keeper._replace("rollout-1")
        assert membership.record(replacement.url).state is MemberState.JOINING
        membership.probe_ok(replacement.url, 0)
        membership.evict(replacement.url, "2 probes failed in a row")  # stopped, not exited
        assert replacement.url in membership.probe_targets()
        membership.probe_ok(replacement.url, 0, sent_at=membership.now() + 1)  # continued: it answers again
        assert membership.record(replacement.url).state is MemberState.JOINING  # back through warm-up
    finally:
        keeper._closed = True
        proc.signal_group(9)
        proc.reap(10)
        keeper.close()

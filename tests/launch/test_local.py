"""LocalScheduler with real processes: `tandem serve` servers, a 2-rank gloo trainer group driven by
RPC, crash detection, Ctrl-C and failed starts. Every test checks that nothing is left running.

Figures are printed (`pytest -rP tests/launch` shows them)."""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import time
import urllib.request

import pytest
import torch

from tandem.launch import (
    GroupBrokenError,
    LaunchError,
    LocalScheduler,
    RemoteError,
    WorkerCrashedError,
)
from tandem.train import TrainController, TrainWorker
from tests.launch.helpers import CPU, HELPERS, HelperWorker
from tests.launch.procs import CHILD_ENV, REPO, alive, can_listen, descendants, in_groups

pytestmark = pytest.mark.slow


def _health(url: str) -> tuple[int, dict]:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(f"{url}/health", timeout=5) as resp:
        return resp.status, json.loads(resp.read())


def _assert_all_gone(sched: LocalScheduler) -> None:
    pids = [p.pid for p in sched.processes]
    assert pids
    assert not [pid for pid in pids if alive(pid)], "child processes survived shutdown"
    assert not in_groups(set(pids)), "processes left in the children's process groups"


def test_servers_and_trainer_group(tmp_path, tiny_model):
    sched = LocalScheduler(tmp_path / "run", env=CHILD_ENV, grace_s=10)
    try:
        t0 = time.monotonic()
        servers = sched.start_servers("tandem:d2", tiny_model, server_args=["--num-threads", "1"], timeout_s=120)
        t1 = time.monotonic()
        group = sched.start_workers("archon:d2", HELPERS, args=CPU, timeout_s=120)
        t2 = time.monotonic()
        print(f"2 servers healthy in {t1 - t0:.1f}s; 2-rank trainer group connected in {t2 - t1:.1f}s")

        assert [s.name for s in servers] == ["rollout-0", "rollout-1"]
        assert len({s.port for s in servers}) == 2
        for s in servers:
            assert _health(s.url) == (200, {"status": "ok", "weight_version": "0"})
            assert s.log_path.exists()

        pings = group.call(HelperWorker.ping)
        assert [p.rank for p in pings] == [0, 1]
        assert [p.pid for p in pings] == group.pids
        assert {p.backend for p in pings} == {"gloo"}

        # A collective: every rank must take part.
        assert group.call(HelperWorker.all_reduce_sum, 1.5) == [3.0, 3.0]
        assert group.call_per_rank(HelperWorker.all_reduce_sum, [(1.0,), (2.0,)]) == [3.0, 3.0]

        # Different tensors to each rank, back intact (several dtypes, views, 0-d, empty).
        gen = torch.Generator().manual_seed(0)
        shards = []
        for r in range(2):
            big = torch.randn(512 * 1024, generator=gen)  # 2 MiB
            shards.append([big, torch.randint(0, 50_000, (128 * 1024,), generator=gen),  # 1 MiB int64
                           big[::3].to(torch.bfloat16), torch.tensor(float(r)), torch.zeros(0, 7),
                           torch.arange(12).reshape(3, 4).t()])
        nbytes = sum(t.numel() * t.element_size() for shard in shards for t in shard)
        start = time.perf_counter()
        out = group.call_per_rank(HelperWorker.echo, [(shard,) for shard in shards])
        dt = time.perf_counter() - start
        for r, (rank, back) in enumerate(out):
            assert rank == r
            for a, b in zip(shards[r], back, strict=True):
                assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
        mb = 2 * nbytes / 2**20  # to the workers and back
        print(f"call_per_rank echo: {nbytes / 2**20:.1f} MiB each way in {dt * 1000:.0f} ms: {mb / dt:.0f} MiB/s")
        assert mb / dt > 50, "tensor transfer is far too slow"

        # A worker exception comes back with its rank and remote traceback; the group stays usable.
        with pytest.raises(RemoteError) as info:
            group.call(HelperWorker.fail_on_rank, 1)
        err = info.value
        assert err.rank == 1 and "deliberate failure on rank 1" in str(err)
        assert "helpers.py" in err.remote_traceback and "ValueError" in err.exc_type
        assert isinstance(err.__cause__, ValueError)
        assert group.call(HelperWorker.ping)[1].rank == 1
        with pytest.raises(TypeError, match=r"Worker\.ping"):  # methods are named by function, never by string
            group.call("ping")

        # The engine through the TrainController: build, one SFT step on per-rank shards, logprobs, HF save.
        from tandem.train import MicroBatchConfig, SequenceBatch, TrainEngineConfig

        trainer = TrainController(group)
        start = time.perf_counter()
        cfg = TrainEngineConfig(path=str(tiny_model), mb=MicroBatchConfig(max_tokens_per_mb=256))
        assert [r.rank for r in trainer.initialize(cfg)] == [0, 1]
        batches = [SequenceBatch.from_token_lists([[5, 6, 7, 8, 9], [10, 11, 12]], loss_mask=[[0, 1, 1, 1, 1], [0, 1, 1]]),
                   SequenceBatch.from_token_lists([[13, 14, 15, 16]], loss_mask=[[0, 0, 1, 1]])]
        stats = group.call_per_rank(TrainWorker.sft_step, [(b,) for b in batches])
        assert stats[0]["loss"] == stats[1]["loss"] and stats[0]["n_loss_tokens"] == 8  # global, same on ranks
        outs = trainer.compute_logprobs(batches)
        assert [len(o.logprobs) for o in outs] == [2, 1] and outs[0].logprobs[0].shape == (5,)
        assert group.call(TrainWorker.step) == [1, 1]
        saved = trainer.save_hf(str(tmp_path / "hf"), tokenizer_dir=str(tiny_model))
        assert (tmp_path / "hf" / "config.json").exists() and saved == str(tmp_path / "hf")
        print(f"engine via RPC: initialize + sft_step + compute_logprobs + save_hf in "
              f"{time.perf_counter() - start:.1f}s; loss {stats[0]['loss']:.4f}")

        rendezvous_port = int(sched.rendezvous_address.rsplit(":", 1)[1])  # the ranks connected to it
        ports = [s.port for s in servers] + [rendezvous_port, group.master_port]
    finally:
        sched.shutdown()
    print(f"teardown (graceful RPC shutdown of the group, SIGTERM to servers): {sched.teardown_s:.2f}s")
    _assert_all_gone(sched)
    assert all(can_listen(p) for p in ports), f"a port is still taken after shutdown: {[p for p in ports if not can_listen(p)]} of {ports}"
    sched.shutdown()  # idempotent


def test_worker_crash_ends_the_call(tmp_path):
    sched = LocalScheduler(tmp_path / "run", env=CHILD_ENV, grace_s=5)
    try:
        # 1) A rank exits while the other waits in a collective.
        a = sched.start_workers(2, HELPERS, args=CPU, name="exit", timeout_s=120)
        start = time.monotonic()
        with pytest.raises(WorkerCrashedError) as info:
            a.call(HelperWorker.exit_on_rank, 1, 3, rpc_timeout=60)
        latency = time.monotonic() - start - 0.2  # the helper sleeps 0.2 s before exiting
        err = info.value
        assert err.rank == 1 and "exit code 3" in str(err) and err.group == "exit"
        assert "serving RPC" in err.log_tail  # the log tail is quoted
        print(f"os._exit(3) on rank 1 during a collective -> WorkerCrashedError after {latency * 1000:.0f} ms")
        assert latency < 5
        with pytest.raises(GroupBrokenError):
            a.call(HelperWorker.ping)

        # 2) SIGKILL of a rank in the middle of a call.
        b = sched.start_workers(2, HELPERS, args=CPU, name="kill", timeout_s=120)
        future = b.submit(HelperWorker.sleep, 60.0)
        time.sleep(0.5)
        killed = time.monotonic()
        os.kill(b.pids[0], signal.SIGKILL)
        with pytest.raises(WorkerCrashedError) as info:
            future.result(timeout=10)
        latency = time.monotonic() - killed
        assert info.value.rank == 0 and "SIGKILL" in str(info.value)
        print(f"SIGKILL of rank 0 during a call -> WorkerCrashedError after {latency * 1000:.0f} ms")
        assert latency < 5

        # 3) A rank dies while the group is idle: the next call fails at once. (The real trainer
        # module this time: its replies unpickle in the controller.)
        trainer = TrainController.start(sched, 2, name="idle", timeout_s=120)
        assert [p.rank for p in trainer.ping()] == [0, 1]
        c = trainer.group
        os.kill(c.pids[1], signal.SIGKILL)
        time.sleep(0.3)
        start = time.monotonic()
        with pytest.raises(WorkerCrashedError) as info:
            c.call(TrainWorker.ping)
        assert info.value.rank == 1 and info.value.method is None  # "while idle"
        print(f"rank killed while idle -> next call fails in {(time.monotonic() - start) * 1000:.0f} ms")
    finally:
        sched.shutdown()
    print(f"teardown after crashes (survivors stuck in collectives): {sched.teardown_s:.2f}s")
    assert sched.teardown_s < 10
    _assert_all_gone(sched)


def _default_sigint() -> None:
    # A controller started from a terminal. A suite launched in the background by a shell (`... &`)
    # inherits SIGINT ignored, and the scheduler deliberately leaves an ignored SIGINT ignored
    # (as under nohup): without this the signal would never arrive.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_ctrl_c_leaves_no_process(tmp_path, tiny_model):
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.launch.controller_proc", str(tiny_model), str(tmp_path / "run")],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True, bufsize=0,
        env={**os.environ, **CHILD_ENV},  # unbuffered: select() sees every line
        preexec_fn=_default_sigint,
    )
    tree: set[int] = set()
    try:
        lines, deadline = [], time.monotonic() + 120
        while "ready" not in lines:
            left = deadline - time.monotonic()
            assert left > 0 and proc.poll() is None, "controller did not get ready:\n" + "\n".join(lines)
            if select.select([proc.stdout], [], [], left)[0]:
                line = proc.stdout.readline().decode().strip()
                lines.append(line)
        pids = set(json.loads(next(x for x in lines if x.startswith("{")))["pids"])
        time.sleep(0.5)  # the controller is inside the RPC call now
        tree = descendants(proc.pid)
        assert pids <= tree and len(pids) == 3
        sent = time.monotonic()
        proc.send_signal(signal.SIGINT)
        try:
            rc = proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pytest.fail("the controller did not exit within 30 s of SIGINT\n" + _hang_report(proc, tmp_path / "run"))
        exit_s = time.monotonic() - sent
        out = proc.stdout.read().decode()
        print(f"SIGINT -> controller exited (rc {rc}) after {exit_s:.2f}s; tree of {len(tree)} processes")
        assert "KeyboardInterrupt" in out or rc == -signal.SIGINT, out
        assert exit_s < 20
        assert not [pid for pid in tree if alive(pid)], "processes of the controller's tree survived Ctrl-C"
        assert not in_groups(tree | {proc.pid})
    finally:
        for pid in tree | {proc.pid}:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)
        proc.kill()
        proc.wait()


def _hang_report(proc: subprocess.Popen, run_dir) -> str:
    """What a controller that does not exit is doing: every thread's stack (faulthandler on
    SIGUSR1), its output so far, which children are alive, and the tail of each child's log."""
    with contextlib.suppress(ProcessLookupError):
        proc.send_signal(signal.SIGUSR1)
    time.sleep(1.0)
    os.set_blocking(proc.stdout.fileno(), False)
    out = b""
    with contextlib.suppress(BlockingIOError, TypeError):
        out = proc.stdout.read() or b""
    parts = [f"controller output and stacks:\n{out.decode(errors='replace')[-6000:]}",
             f"alive descendants: {sorted(pid for pid in descendants(proc.pid) if alive(pid))}"]
    for log in sorted(run_dir.glob("logs/*")):
        parts.append(f"--- {log.name} (tail)\n" + "\n".join(log.read_text(errors="replace").splitlines()[-15:]))
    return "\n".join(parts)


def test_server_that_fails_to_start(tmp_path):
    sched = LocalScheduler(tmp_path / "run", env=CHILD_ENV, grace_s=5)
    try:
        start = time.monotonic()
        with pytest.raises(LaunchError) as info:
            sched.start_servers(1, tmp_path / "no-such-model", server_args=["--num-threads", "1"], timeout_s=60)
        took = time.monotonic() - start
        msg = str(info.value)
        print(f"bad model path -> LaunchError after {took:.1f}s:\n{msg.splitlines()[0]}")
        assert "rollout-0" in msg and "does not exist" in msg and "last lines of its log" in msg
        assert took < 60
        assert not [p.pid for p in sched.processes if alive(p.pid)]  # nothing left even before shutdown
    finally:
        sched.shutdown()
    _assert_all_gone(sched)


def test_relaunch_into_a_run_directory_with_old_logs(tmp_path, tiny_model):
    """A second launch into the same run directory must read its own server's listening line, not
    the previous launch's (whose port is dead, so the start would wait out its deadline and fail):
    it comes up about as fast as the first, timed in the same test (a fixed 30 s bound failed with
    other test runs beside this one)."""
    run = tmp_path / "run"
    first = LocalScheduler(run, env=CHILD_ENV, grace_s=5)
    try:
        start = time.monotonic()
        old = first.start_servers(1, tiny_model, server_args=["--num-threads", "1"], timeout_s=240)[0]
        first_took = time.monotonic() - start
    finally:
        first.shutdown()
    second = LocalScheduler(run, env=CHILD_ENV, grace_s=5)
    try:
        start = time.monotonic()
        new = second.start_servers(1, tiny_model, server_args=["--num-threads", "1"], timeout_s=240)[0]
        took = time.monotonic() - start
        print(f"relaunch into {run}: healthy in {took:.1f}s, the first launch in {first_took:.1f}s "
              f"(old port {old.port}, new {new.port})")
        assert took < 2 * first_took + 10
        assert new.port != old.port
        assert _health(new.url)[0] == 200
        log = new.log_path.read_text()
        assert log.count("listening on") == 2  # one log file per role, appended launch after launch
    finally:
        second.shutdown()
    _assert_all_gone(second)

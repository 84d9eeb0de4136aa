"""Rewards run in worker processes with a timeout; failures become reasons, hung workers are killed."""

from __future__ import annotations

import asyncio
import threading
import time
import warnings
from pathlib import Path

import pytest

from tandem.rollout import RewardRunner
from tandem.rollout.reward import RewardResult
from tests.launch.pool_owner import kill_owner_and_check, start_owner
from tests.launch.procs import Marked
from tests.rollout import rewards
from tests.rollout.conftest import run

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def runner():
    r = RewardRunner(max_workers=2, timeout_s=1.0, grace_s=0.5)
    yield r
    r.close()


def score(runner, fn, **fields):
    return run(runner.ascore(fn, "p", "c", [1, 2], [3, 4], **fields))


def test_reward_values_and_fields(runner):
    assert score(runner, rewards.parity_reward).value == 1.0
    assert score(runner, rewards.fields_reward, answer=0.25).value == 0.25


def test_raising_reward_is_a_reason(runner):
    res = score(runner, rewards.raising_reward)
    assert res.value is None and "ValueError: the grader crashed" in res.error


def test_non_finite_reward_is_rejected(runner):
    res = score(runner, rewards.nan_reward)
    assert res.value is None and "not a finite number" in res.error


def test_hanging_reward_times_out_softly(runner):
    """The soft timer ends the call (its message, not the hard deadline's) and the worker lives on."""
    before = runner.num_recycled
    res = score(runner, rewards.sleepy_reward)
    assert res.value is None and "ran past 1s" in res.error
    assert runner.num_recycled == before  # no worker was killed
    assert score(runner, rewards.parity_reward).value == 1.0  # the worker is reused


def test_a_group_is_one_call_and_its_failures_stay_per_completion(runner):
    """ascore_group: one round trip to the pool for the whole group; a completion that raises,
    returns NaN or runs past its own soft timeout fails alone, its siblings keep their values."""
    texts = ["0.5", "raise", "2", "nan", "sleep", "-1"]
    before = next(runner._tokens)
    results = run(runner.ascore_group(rewards.scripted_reward, "p", [1], [(t, [len(t)]) for t in texts]))
    assert next(runner._tokens) == before + 2  # one call to the pool (and this probe)
    assert [r.value for r in results] == [0.5, None, 2.0, None, None, -1.0]
    assert "ValueError: the grader crashed" in results[1].error and "not a finite number" in results[3].error
    assert "ran past 1s" in results[4].error and results[4].error.startswith("scripted_reward: ")


def test_a_stuck_completion_fails_its_group_within_the_groups_deadline():
    """A completion that defeats the soft timer: the worker is killed once the group's soft
    timeouts and the grace have passed (3 x 1 s + 0.5 s), and every completion of the group fails."""
    runner = RewardRunner(max_workers=1, timeout_s=1.0, grace_s=0.5)
    try:
        # The worker first: its start (seconds on a loaded machine; the 20 s bound was nearly
        # reached once, at 9d36349) is not what this test times.
        assert run(runner.ascore(rewards.scripted_reward, "p", "0", [1], [2])).value == 0.0
        start = time.monotonic()
        results = run(runner.ascore_group(rewards.scripted_reward, "p", [1], [("1", [1]), ("stubborn", [2]), ("3", [3])]))
        assert 3.5 <= time.monotonic() - start < 20
        assert all(r.value is None and "worker killed" in r.error for r in results)
        assert runner.num_recycled == 1
        assert run(runner.ascore(rewards.scripted_reward, "p", "4", [1], [2])).value == 4.0  # a fresh pool
    finally:
        runner.close()


def test_worker_start_up_does_not_count_against_the_timeout():
    """Catches the hard deadline counting from submission: a fresh pool's workers import the
    reward's module first (1.5 s here, more on a loaded machine), which must not use up a 0.3 s
    reward timeout and get an innocent, instant reward killed as stuck."""
    from tests.rollout import slow_import_reward

    runner = RewardRunner(max_workers=1, timeout_s=0.3, grace_s=0.3, start_timeout_s=40.0)
    snapshot = threading.Timer(15.0, lambda: notes.append(pool_snapshot(runner)))
    notes: list[str] = []
    try:
        start = time.monotonic()
        snapshot.start()
        res = run(runner.ascore(slow_import_reward.quick_reward, "p", "c", [1], [2]), timeout=50.0)
        took = time.monotonic() - start
        snapshot.cancel()
        # A start-up this slow passed once in many suite runs and once ran past the 20 s bound this
        # test had (35ecc16): what the pool was doing at 15 s goes to the warnings summary.
        if notes:
            warnings.warn(f"the reward worker took {took:.1f}s to take the call up: {notes[0]}", stacklevel=1)
        assert res.ok and res.value == 1.0, (res.error, notes)
        assert took > slow_import_reward.IMPORT_S  # the import really came before the call
        assert runner.num_recycled == 0
    finally:
        snapshot.cancel()
        runner.close()


def pool_snapshot(runner: RewardRunner) -> str:
    """Where a reward pool stands: its workers' kernel states and the stacks of its parent-side
    threads (the executor's manager, the call queue's feeder), for a call that waits too long."""
    import sys
    import traceback

    pool = runner._pool
    if pool is None:
        return "no pool"
    lines = []
    for pid in list((pool._processes or {}).keys()):
        try:
            stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            wchan = Path(f"/proc/{pid}/wchan").read_text()
            lines.append(f"worker {pid}: state {stat[0]}, wchan {wchan}, utime+stime {int(stat[11]) + int(stat[12])} ticks")
        except OSError as exc:
            lines.append(f"worker {pid}: {exc}")
    lines.append(f"pending work items: {len(pool._pending_work_items)}")
    frames = sys._current_frames()
    for thread in threading.enumerate():
        if thread.ident in frames and ("Manager" in type(thread).__name__ or "QueueFeederThread" in thread.name):
            stack = "".join(traceback.format_stack(frames[thread.ident], limit=6))
            lines.append(f"thread {thread.name}:\n{stack}")
    return "\n".join(lines)


def test_stubborn_hang_kills_the_worker_and_the_pool_recovers(runner):
    pool, _ = runner._get_pool()
    score(runner, rewards.parity_reward)  # make sure workers exist
    before = runner.num_recycled

    async def both():
        # An innocent reward running alongside the stuck one must still get its value.
        return await asyncio.gather(
            runner.ascore(rewards.stubborn_reward, "p", "c", [1], [2]),
            runner.ascore(rewards.parity_reward, "p", "c", [1], [2]),
        )

    start = time.monotonic()
    stuck, innocent = run(both())
    # The stuck call sleeps 40 s: ending well inside that shows the hard kill at timeout + grace
    # (1.5 s here; a pool respawn on top took up to ~5 s with three test suites on 2 cores).
    assert time.monotonic() - start < 20
    assert stuck.value is None and "worker killed" in stuck.error
    assert innocent.value == 1.0
    assert runner.num_recycled == before + 1
    procs = list(pool._processes.values()) if pool._processes else []
    assert all(not p.is_alive() for p in procs)  # no stuck worker left behind
    assert score(runner, rewards.parity_reward).value == 1.0  # fresh pool works


def test_calls_queued_in_a_recycled_pool_are_scored_not_cancelled():
    """Evaluation and the rollout executor score on different event loops, each allowed
    `max_workers` calls, so calls can wait inside the pool. When a stuck call recycles the pool,
    `shutdown(cancel_futures=True)` cancels the waiting ones: that must not surface as an
    asyncio.CancelledError in their callers (it ended evaluations on loaded CI machines) but be
    retried on the fresh pool, as a call broken by the recycling is."""

    runner = RewardRunner(max_workers=1, timeout_s=1.0, grace_s=0.5)
    try:
        score(runner, rewards.parity_reward)  # the one worker exists
        results: dict[str, object] = {}

        def call(name: str, fn, delay: float) -> None:
            time.sleep(delay)  # each thread is its own event loop, with its own slot
            try:
                results[name] = asyncio.run(runner.ascore(fn, "p", "c", [1], [2]))
            except BaseException as exc:  # what a caller would see
                results[name] = exc

        threads = [threading.Thread(target=call, args=("stuck", rewards.stubborn_reward, 0.0)),
                   *(threading.Thread(target=call, args=(f"queued{i}", rewards.parity_reward, 0.3 + i / 10))
                     for i in range(4))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert runner.num_recycled == 1
        assert "worker killed" in results["stuck"].error
        queued = [results[f"queued{i}"] for i in range(4)]
        assert all(isinstance(r, RewardResult) for r in queued), results  # nothing raised to a caller
        # The pool moves up to two waiting calls into its call queue (they then fail with the stuck
        # one's worker); the others were still waiting, were cancelled, and are scored on the fresh pool.
        assert sum(r.value == 1.0 for r in queued) >= 2, results
    finally:
        runner.close()


def test_close_while_scoring_is_final_and_quick():
    """Closing the runner while a reward runs (the end of a run): the call ends within the close's
    grace, later calls are refused, and no new worker pool is started behind the closed one."""
    from tandem.rollout.reward import RewardRunnerClosed

    runner = RewardRunner(max_workers=1, timeout_s=30)

    async def main():
        call = asyncio.ensure_future(runner.ascore(rewards.sleepy_reward, "p", "c", [1], [2]))
        await asyncio.sleep(1.0)  # the worker is inside the reward, 29 s from its timeout
        start = time.monotonic()
        await asyncio.to_thread(runner.close)
        closed_in = time.monotonic() - start
        with pytest.raises(RewardRunnerClosed):
            await asyncio.wait_for(call, 10)
        with pytest.raises(RewardRunnerClosed):
            await runner.ascore(rewards.parity_reward, "p", "c", [1], [2])
        return closed_in

    closed_in = run(main())
    print(f"closed with a reward running in {closed_in:.2f}s")
    # Killed after the 1 s grace, not waited for (29 s more). Kill and reap take ~0.1 s here; the
    # margin is a loaded host's (2.75 s in all in a suite run at ae0f097, when the reward was 3 s
    # long and ending by itself 2 s after the close began could not be told from a kill).
    assert closed_in < runner.grace_s + 4.0
    assert runner._pool is None  # nothing resurrected after close


def test_pool_dies_with_its_owner():
    """SIGKILL of the process that owns a RewardRunner leaves none of the pool's processes (its
    workers, the fork server, the resource tracker) and none of its semaphores."""
    marked = Marked()
    try:
        proc, workers = start_owner(marked, "tests.launch.pool_owner", "runner")
        kill_owner_and_check(marked, proc, workers, "RewardRunner")
    finally:
        marked.clean_up()

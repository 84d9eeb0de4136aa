"""The workflow executor: episodes run on an asyncio loop in a thread, bounded by staleness.

Callers submit items; the loop starts an episode whenever the staleness capacity allows and
dispatch is not paused, and finished episodes notify a `threading.Condition` that `wait` /
`prepare_batch` block on (nothing polls). `ExecutorConfig.order`: "dispatch" (default) hands out
accepted episodes in start order, which makes the staleness bound hold for every trajectory;
"completion" hands them out as they finish. A failed episode is rejected; after
`max_consecutive_failures` in a row every waiter gets `EpisodeFailureStorm`. See docs/rollout.md,
"The staleness bound" and "The executor"."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from tandem.aio import new_event_loop
from tandem.data.trajectory import Trajectory
from tandem.log_repeats import RepeatCounter
from tandem.rollout.client import InferenceClient
from tandem.rollout.dump import TrajectoryDumper
from tandem.rollout.errors import EpisodeFailureStorm, RolloutError
from tandem.rollout.frontier import DrawFrontier, FrontierState, stream_index_of
from tandem.rollout.staleness import StalenessManager
from tandem.rollout.workflows.base import RolloutWorkflow, as_trajectories

logger = logging.getLogger(__name__)


@dataclass
class ExecutorConfig:
    max_concurrent_rollouts: int = 64
    consumer_batch_size: int = 8  # episodes per training batch
    max_staleness: int = 1
    order: Literal["dispatch", "completion"] = "dispatch"
    dump_dir: str | None = None  # JSONL per version when set
    max_consecutive_failures: int | None = None  # an error storm ends the executor; None: never


class EpisodeScorer(Protocol):
    """Awaited on every episode a workflow returned, before it is accepted (a teacher's logprobs,
    a reward model's rewards: `tandem.rollout.scoring`): fills fields of the trajectories in place;
    raising fails the episode."""

    async def ascore(self, trajectories: list[Trajectory], item: Mapping[str, Any] | None = None) -> None:
        """`item`: the episode's item (its fields, e.g. a judge's reference answer)."""

    async def aclose(self) -> None:
        """Release what `ascore` opened on the executor's loop (called there at shutdown)."""


def sole_cause(exc: BaseException) -> BaseException:
    """The one exception inside (nested) exception groups of one member each, e.g. a scorer's
    error through the task groups that ran it: what an episode's failure should name."""
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    return exc


@dataclass
class _Episode:
    item: Any
    workflow: RolloutWorkflow
    future: concurrent.futures.Future | None  # private result (rollout_batch); None: shared queue
    seq: int = -1
    version: int = -1  # trainer version when the episode started
    index: int | None = None  # the item's position in the run's stream (`tandem.rollout.frontier`)


class WorkflowExecutor:
    def __init__(self, client: InferenceClient, config: ExecutorConfig | None = None,
                 scorers: Sequence[EpisodeScorer] = ()):
        """`scorers` score each returned episode, concurrently, before it is accepted."""
        self.client = client
        self.scorers = list(scorers)
        self.config = cfg = config or ExecutorConfig()
        if cfg.order not in ("dispatch", "completion"):
            raise ValueError(f"order must be 'dispatch' or 'completion', got {cfg.order!r}")
        self.staleness = StalenessManager(cfg.max_concurrent_rollouts, cfg.consumer_batch_size, cfg.max_staleness)
        self._dumper = TrajectoryDumper(cfg.dump_dir) if cfg.dump_dir else None
        # One condition guards all shared state below; it is never held across I/O.
        self._cond = threading.Condition()
        self._pending: deque[_Episode] = deque()  # submitted, not started
        self._order: deque[int] = deque()  # started queue episodes, unresolved ("dispatch" order)
        self._done: dict[int, tuple[int | None, list[Trajectory] | None]] = {}
        self._ready: deque[tuple[int | None, list[Trajectory]]] = deque()  # accepted episodes (stream index), oldest first
        self._frontier = DrawFrontier()  # which drawn items are done with (handed out or rejected)
        self._paused = False
        self._closed = False
        self._error: BaseException | None = None
        self.version = client.version  # the controller's; read here, never written
        self.version.watch(self._on_version)
        self._counts = {"accepted": 0, "rejected": 0, "failed": 0}
        self._streak = 0  # episodes failed in a row
        self._streak_first = ""  # the first error of the current streak
        self._errors = RepeatCounter(logger, level=logging.ERROR)
        self._seq = itertools.count()
        self._sources: dict[int, tuple[Any, Iterator[Any]]] = {}
        self._tasks: set[asyncio.Task] = set()
        self._loop = new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="tandem-rollout", daemon=True)
        self._thread.start()

    # -- controls -------------------------------------------------------------------------------
    def _on_version(self, version: int) -> None:
        """The trainer's version moved on (after a weight update): capacity grows."""
        with self._cond:
            self._cond.notify_all()
        self._kick()

    def pause(self) -> None:
        """No episode starts after this returns (running ones continue; the servers pause them)."""
        with self._cond:
            self._paused = True

    def resume(self) -> None:
        with self._cond:
            self._paused = False
            self._cond.notify_all()
        self._kick()

    def fail(self, error: BaseException) -> None:
        """Stop starting episodes; every waiter (now and later) gets `error` as the cause (the
        controller calls it when the fleet stayed too small for too long)."""
        with self._cond:
            if self._error is None:
                self._error = error
            self._cond.notify_all()

    # -- submitting and collecting --------------------------------------------------------------
    def submit(self, item: Any, workflow: RolloutWorkflow) -> None:
        """Queue one episode; its accepted trajectories come out of `wait` / `prepare_batch`."""
        self._enqueue(_Episode(item, workflow, None, index=stream_index_of(item)))

    def wait(self, count: int, timeout: float | None = None) -> list[Trajectory]:
        """Block until `count` accepted episodes are ready; return their trajectories, oldest first.

        `count` is in episodes (an RLVR group is one episode); the list is flat, groups contiguous.
        """
        with self._cond:
            ok = self._cond.wait_for(lambda: len(self._ready) >= count or self._dead(), timeout)
            self._raise_if_dead()
            if not ok:
                raise TimeoutError(
                    f"{len(self._ready)}/{count} accepted episodes after {timeout}s "
                    f"(running={self.staleness.stats().running}, pending={len(self._pending)}, paused={self._paused})"
                )
            return self._take(count)

    def rollout_batch(self, items: Iterable[Any], workflow: RolloutWorkflow, timeout: float | None = None) -> list[Trajectory]:
        """Run these items and return their accepted trajectories in item order."""
        futures = []
        for item in items:
            fut: concurrent.futures.Future = concurrent.futures.Future()
            self._enqueue(_Episode(item, workflow, fut))
            futures.append(fut)
        _, not_done = concurrent.futures.wait(futures, timeout)
        if not_done:
            raise TimeoutError(f"{len(not_done)}/{len(futures)} episodes unfinished after {timeout}s")
        return [t for f in futures for t in (f.result() or [])]

    def prepare_batch(
        self, dataloader: Iterable[Any], workflow: RolloutWorkflow, batch_size: int | None = None, timeout: float | None = None
    ) -> list[Trajectory]:
        """Keep the pipeline full from `dataloader` (cycled) and return the oldest `batch_size` episodes.

        Items are drawn as capacity opens, plus one batch queued ahead so that slots freed while the
        caller trains are filled at once; what is left running or queued stays for the next call.
        """
        batch_size = batch_size or self.config.consumer_batch_size
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            with self._cond:
                self._raise_if_dead()
                want = 0
                if not self._paused:
                    capacity = max(0, self.staleness.capacity(self.version.value))
                    want = capacity + batch_size - len(self._pending)
                if want <= 0:
                    if len(self._ready) >= batch_size:
                        return self._take(batch_size)
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is not None and left <= 0:
                        raise TimeoutError(f"{len(self._ready)}/{batch_size} accepted episodes after {timeout}s")
                    self._cond.wait(left)  # woken by a finished episode, a new version, resume, shutdown
                    continue
            for _ in range(want):  # draw outside the lock: a dataloader may block
                self.submit(self._next_item(dataloader), workflow)

    def frontier(self) -> FrontierState:
        """The stream positions done with so far (`tandem.rollout.frontier`): what a checkpoint
        saves so that a resumed run draws again exactly the items not handed out or rejected."""
        with self._cond:
            return self._frontier.state()

    def restore_frontier(self, state: FrontierState) -> None:
        """Continue a run whose checkpoint saved `state` (before any item is drawn)."""
        with self._cond:
            self._frontier = DrawFrontier(state)

    def stats(self) -> dict[str, Any]:
        s = self.staleness.stats()
        with self._cond:
            return {
                "version": self.version.value, "paused": self._paused, "pending": len(self._pending),
                "ready": len(self._ready), "running": s.running, "submitted": s.submitted, **self._counts,
            }

    def shutdown(self, timeout: float = 10.0) -> None:
        with self._cond:
            if self._closed:
                return
            self._closed = True
            dropped, self._pending = list(self._pending), deque()
            self._cond.notify_all()
        for ep in dropped:
            if ep.future is not None:
                ep.future.cancel()
        try:
            asyncio.run_coroutine_threadsafe(self._aclose(), self._loop).result(timeout)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout)
            if not self._thread.is_alive():
                self._loop.close()

    def __enter__(self) -> WorkflowExecutor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # -- internals (caller side) ----------------------------------------------------------------
    def _enqueue(self, ep: _Episode) -> None:
        with self._cond:
            self._raise_if_dead()
            self._pending.append(ep)
        self._kick()

    def _kick(self) -> None:
        if not self._closed:
            with contextlib.suppress(RuntimeError):  # the loop closed under us (shutdown raced us)
                self._loop.call_soon_threadsafe(self._dispatch)

    def _dead(self) -> bool:
        return self._closed or self._error is not None

    def _raise_if_dead(self) -> None:
        if isinstance(self._error, RolloutError):  # a storm, a fleet too small: says what to do itself
            raise self._error
        if self._error is not None:
            raise RuntimeError(f"the rollout executor failed: {self._error}") from self._error
        if self._closed:
            raise RuntimeError("the rollout executor is shut down")

    def _take(self, count: int) -> list[Trajectory]:
        out = []
        for _ in range(count):
            index, trajectories = self._ready.popleft()
            if index is not None:
                self._frontier.resolve(index, trained=True)
            out += trajectories
        return out

    def _next_item(self, dataloader: Iterable[Any]) -> Any:
        key = id(dataloader)
        entry = self._sources.get(key)
        if entry is None or entry[0] is not dataloader:
            entry = self._sources[key] = (dataloader, iter(dataloader))
        try:
            return next(entry[1])
        except StopIteration:  # next epoch
            it = iter(dataloader)
            self._sources[key] = (dataloader, it)
            try:
                return next(it)
            except StopIteration:
                raise ValueError("the dataloader is empty or exhausted (a generator cannot restart)") from None

    # -- internals (loop thread) ----------------------------------------------------------------
    def _dispatch(self) -> None:
        try:
            while True:
                with self._cond:
                    if self._paused or self._dead() or not self._pending:
                        return
                    if self.staleness.capacity(self.version.value) <= 0:
                        return
                    ep = self._pending.popleft()
                    ep.seq, ep.version = next(self._seq), self.version.value
                    self.staleness.on_submit()
                    if ep.future is None and self.config.order == "dispatch":
                        self._order.append(ep.seq)
                task = self._loop.create_task(self._run_episode(ep))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
        except Exception as exc:  # a bug, not a bad episode: fail loudly instead of stalling waiters
            logger.exception("rollout dispatch failed")
            with self._cond:
                self._error = exc
                self._cond.notify_all()

    async def _run_episode(self, ep: _Episode) -> None:
        error = None
        try:
            result = as_trajectories(await ep.workflow.arun_episode(self.client, ep.item))
            if result is None:
                logger.info("episode %d rejected by its workflow (item %.200r)", ep.seq, ep.item)
            elif self.scorers:
                async with asyncio.TaskGroup() as tg:  # one failing cancels the others: the episode fails
                    for scorer in self.scorers:
                        tg.create_task(scorer.ascore(result, ep.item))
        except asyncio.CancelledError:  # shutdown
            self.staleness.on_reject()
            if ep.future is not None:
                ep.future.cancel()
            raise
        except Exception as exc:
            exc = sole_cause(exc)
            error = f"{type(exc).__name__}: {exc}"
            self._errors.log(error, f"episode {ep.seq} failed and is rejected (item {ep.item!r:.200}): {error}",
                             exc_info=exc)
            result = None
        if result is None:
            self.staleness.on_reject()
        else:
            self.staleness.on_accept()
            if self._dumper is not None:
                await asyncio.to_thread(self._dumper.write, self.version.value, result)
        self._finish(ep, result, error)
        self._dispatch()

    def _finish(self, ep: _Episode, result: list[Trajectory] | None, error: str | None) -> None:
        with self._cond:
            self._counts["accepted" if result is not None else "rejected"] += 1
            self._counts["failed"] += error is not None
            self._track_streak(result is not None, error)
            if ep.future is None:
                if ep.index is not None:
                    for t in result or ():
                        t.stream_index = ep.index
                    if result is None:  # rejected: done with, never handed out
                        self._frontier.resolve(ep.index)
                if self.config.order == "completion":
                    if result is not None:
                        self._ready.append((ep.index, result))
                else:
                    self._done[ep.seq] = (ep.index, result)
                    while self._order and self._order[0] in self._done:
                        index, done = self._done.pop(self._order.popleft())
                        if done is not None:
                            self._ready.append((index, done))
            self._cond.notify_all()
        if ep.future is not None and not ep.future.done():
            ep.future.set_result(result)

    def _track_streak(self, accepted: bool, error: str | None) -> None:  # under self._cond
        if accepted:
            self._streak = 0
        if error is None:
            return
        if self._streak == 0:
            self._streak_first = error
        self._streak += 1
        limit = self.config.max_consecutive_failures
        if limit is not None and self._streak >= limit and self._error is None:
            self._errors.flush()
            self._error = EpisodeFailureStorm(self._streak, self._streak_first)
            logger.error("%s", self._error)
            dropped, self._pending = list(self._pending), deque()
            for ep in dropped:  # never started: their callers get the storm too
                if ep.future is not None and not ep.future.done():
                    ep.future.set_exception(self._error)

    async def _aclose(self) -> None:
        """Cancel and await every task on this loop: the episodes and anything a workflow started
        (reward calls, sub-requests), so the loop closes with nothing pending and no coroutine is
        destroyed unfinished at exit."""
        me = asyncio.current_task()
        while tasks := [t for t in asyncio.all_tasks() if t is not me and not t.done()]:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        await self.client.aclose()
        for scorer in self.scorers:
            await scorer.aclose()

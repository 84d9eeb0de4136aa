"""Reward functions run in a process pool, off the event loop, each under a timeout.

    def reward(prompt_text, completion_text, prompt_ids, completion_ids, **item_fields) -> float

A Python-level hang is interrupted inside the worker at `timeout_s`; a worker still stuck at
`timeout_s + grace_s` is killed with its pool and a fresh one starts (innocent calls are retried
once). Both clocks start when a worker takes the call up, and at most `max_workers` calls per event
loop are in the pool. A reward that raises, hangs or returns a non-number gives
`RewardResult(value=None, error=...)`. Workers die with the runner's owner
(`tandem.launch.guard.die_with_creator`). A reward with a `sandbox` parameter gets a
`tandem.sandbox.Sandbox` on its worker's pool (`sandbox=` limits), whose executions end by the
call's soft timeout. See docs/rollout.md, "Rewards"."""

from __future__ import annotations

import asyncio
import inspect
import itertools
import logging
import math
import multiprocessing
import os
import signal
import sys
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from typing import Any

from tandem.launch.guard import die_with_creator
from tandem.sandbox import Deadline, Sandbox, SandboxConfig
from tandem.user_code import UserFunction

logger = logging.getLogger(__name__)

RewardFn = Callable[..., float]


@dataclass
class RewardResult:
    value: float | None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.value is not None


class RewardRunnerClosed(RuntimeError):
    """The runner was closed: no more rewards are scored (the run is ending)."""


class _AlarmTimeout(Exception):
    pass


def _on_alarm(signum: int, frame: Any) -> None:
    raise _AlarmTimeout()


class _StartBoard:
    """Shared memory where a pool's workers post the call each is running and since when: one
    slot per worker, claimed at start-up. CLOCK_MONOTONIC is one clock for every process on the
    machine, so the parent compares the posted times with its own `time.monotonic()`."""

    def __init__(self, ctx: multiprocessing.context.BaseContext, slots: int):
        self.next_slot = ctx.Value("i", 0)
        self.tokens = ctx.Array("q", slots, lock=False)
        self.since = ctx.Array("d", slots, lock=False)

    def claim(self) -> int:
        with self.next_slot.get_lock():
            slot = self.next_slot.value
            self.next_slot.value += 1
        return slot

    def post(self, slot: int, token: int) -> None:
        if 0 <= slot < len(self.tokens):
            self.since[slot] = time.monotonic()
            self.tokens[slot] = token  # after the time: a reader that sees the token sees its time

    def started_at(self, token: int) -> float | None:
        """When a worker took call `token` up; None while no worker has (or once it moved on)."""
        for slot, posted in enumerate(self.tokens):
            if posted == token:
                return self.since[slot]
        return None


_board: _StartBoard | None = None  # worker side: this worker's board and slot (set by _init_worker)
_slot = -1
_sandbox_config: SandboxConfig | None = None  # worker side: the limits of its sandbox pool


def wants_sandbox(fn: RewardFn) -> bool:
    """Whether a reward asks for the sandbox: its signature has a parameter named `sandbox` (a
    `UserFunction` is looked at through the function it names, imported here; one that cannot be
    imported asks for nothing, and its worker reports why it cannot run)."""
    try:
        target = fn.load() if isinstance(fn, UserFunction) else fn
        return "sandbox" in inspect.signature(target).parameters
    except Exception:  # an unimportable user file, a callable without a signature
        return False


def _run_with_alarm(fn: RewardFn, timeout_s: float, calls: list[tuple], kwargs: dict[str, Any], label: str = "",
                    token: int = 0, sandbox: str | None = None) -> list[tuple[bool, Any]]:
    """Worker side: post `token` as started, then call `fn` on each argument tuple in turn, each
    under its own soft timeout (the worker runs them on its main thread). Per call (True, value)
    or (False, why), so that one failing call leaves its siblings' values. With `sandbox` (what
    sets the deadline, for its reasons), each call gets `sandbox=`, a Sandbox whose executions end
    by that call's timeout."""
    if _board is not None:
        _board.post(_slot, token)
    name = getattr(fn, "__name__", fn)
    out: list[tuple[bool, Any]] = []
    for args in calls:
        previous = signal.signal(signal.SIGALRM, _on_alarm)
        signal.setitimer(signal.ITIMER_REAL, timeout_s)
        try:
            if sandbox is not None:
                kwargs = {**kwargs, "sandbox": Sandbox(_sandbox_config, Deadline(time.monotonic() + timeout_s, sandbox))}
            out.append((True, fn(*args, **kwargs)))
        except _AlarmTimeout:
            out.append((False, f"reward {name!r} ran past {timeout_s:g}s{label}"))
        except Exception as exc:  # the reward itself raised
            out.append((False, f"{type(exc).__name__}: {exc}"))
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)
    return out


def _result(name: str, ok: bool, value: Any) -> RewardResult:
    if not ok:
        return RewardResult(None, f"{name}: {value}")
    if not isinstance(value, int | float) or isinstance(value, bool) or not math.isfinite(value):
        return RewardResult(None, f"{name}: returned {value!r}, not a finite number")
    return RewardResult(float(value))


def _init_worker(creator_pid: int, board: _StartBoard, sandbox: SandboxConfig | None = None) -> None:
    """A pool worker dies with the process that owns the runner, and leaves Ctrl-C to it: a
    terminal sends SIGINT to the whole foreground process group, workers included, and the owner
    stops the pool itself (a worker interrupted mid-call would print a KeyboardInterrupt traceback).
    It claims its slot on the pool's start board, and keeps the limits of its sandbox pool (made
    on the first call that asks for it)."""
    global _board, _slot, _sandbox_config
    die_with_creator(creator_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _board, _slot = board, board.claim()
    _sandbox_config = sandbox


def _default_context() -> str:
    # forkserver: cheap workers that do not inherit the controller's threads; spawn elsewhere.
    return "forkserver" if sys.platform.startswith("linux") else "spawn"


class RewardRunner:
    def __init__(self, max_workers: int = 2, timeout_s: float = 15.0, grace_s: float = 1.0, mp_context: str | None = None,
                 timeout_key: str | None = None, start_timeout_s: float | None = None,
                 sandbox: SandboxConfig | None = None):
        """`timeout_key`: the setting `timeout_s` came from, named in timeout errors (e.g.
        task.reward_timeout_s). `start_timeout_s`: how long a call may wait for a worker to take it
        up (start-up and queueing; default 60 s plus twice `timeout_s + grace_s`). `sandbox`: the
        limits of each worker's sandbox pool (rollout.sandbox; default: SandboxConfig's)."""
        self.max_workers = max_workers
        self.sandbox = sandbox
        self.timeout_s = timeout_s
        self.timeout_key = timeout_key
        self._label = f" (the timeout, {timeout_key})" if timeout_key else ""
        self.grace_s = grace_s
        self.start_timeout_s = 60.0 + 2 * (timeout_s + grace_s) if start_timeout_s is None else start_timeout_s
        self._ctx = multiprocessing.get_context(mp_context or _default_context())
        self._lock = threading.Lock()
        self._pool: ProcessPoolExecutor | None = None
        self._board: _StartBoard | None = None  # the current pool's
        self._tokens = itertools.count(1)
        self._slots: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Semaphore] = (
            weakref.WeakKeyDictionary()
        )
        self._wants: dict[Any, bool] = {}  # reward -> whether it asks for the sandbox
        self.num_recycled = 0  # pools retired because a worker was stuck (for tests and stats)
        self._closed = False

    def __getstate__(self) -> dict[str, Any]:
        """Pickles as its settings (a workflow sent to a rollout worker): the copy starts its own pool."""
        return {"max_workers": self.max_workers, "timeout_s": self.timeout_s, "grace_s": self.grace_s,
                "mp_context": self._ctx.get_start_method(), "timeout_key": self.timeout_key,
                "start_timeout_s": self.start_timeout_s, "sandbox": self.sandbox}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(**state)

    def _get_pool(self) -> tuple[ProcessPoolExecutor, _StartBoard]:
        with self._lock:
            if self._closed:
                raise RewardRunnerClosed("the reward runner is closed")
            if self._pool is None or self._board is None:
                self._board = _StartBoard(self._ctx, self.max_workers)
                self._pool = ProcessPoolExecutor(self.max_workers, mp_context=self._ctx,
                                                 initializer=_init_worker,
                                                 initargs=(os.getpid(), self._board, self.sandbox))
            return self._pool, self._board

    def _slot(self) -> asyncio.Semaphore:
        loop = asyncio.get_running_loop()
        with self._lock:
            sem = self._slots.get(loop)
            if sem is None:
                sem = self._slots[loop] = asyncio.Semaphore(self.max_workers)
            return sem

    def _recycle(self, pool: ProcessPoolExecutor) -> None:
        """Kill the workers of `pool` (one is stuck) and let the next call start a fresh pool."""
        with self._lock:
            if self._pool is not pool:
                return  # someone else already recycled it
            self._pool = None
            self.num_recycled += 1
        # No public API kills a stuck worker; `_processes` is the pool's own pid -> Process map.
        for proc in list((getattr(pool, "_processes", None) or {}).values()):
            proc.kill()
        pool.shutdown(wait=False, cancel_futures=True)

    async def ascore(
        self,
        fn: RewardFn,
        prompt_text: str,
        completion_text: str,
        prompt_ids: list[int],
        completion_ids: list[int],
        **item_fields: Any,
    ) -> RewardResult:
        return (await self.ascore_group(fn, prompt_text, prompt_ids, [(completion_text, completion_ids)],
                                        **item_fields))[0]

    async def ascore_group(
        self,
        fn: RewardFn,
        prompt_text: str,
        prompt_ids: list[int],
        completions: Sequence[tuple[str, list[int]]],
        **item_fields: Any,
    ) -> list[RewardResult]:
        """The rewards of several completions of one prompt (an RLVR group), in one call to one
        worker: each completion still runs under its own `timeout_s`, and one that raises or runs
        past it fails alone. A worker stuck for good is killed at `len(completions) * timeout_s +
        grace_s`, and the whole group fails. One round trip to the pool instead of one per
        completion (2 cores, 2 workers: 32 completions one by one 4.5-6.4 ms, as 8 groups of 4
        1.2-1.5 ms)."""
        calls = [(prompt_text, text, list(prompt_ids), list(ids)) for text, ids in completions]
        async with self._slot():
            return await self._score(fn, calls, item_fields)

    async def _score(self, fn: RewardFn, calls: list[tuple], item_fields: dict[str, Any]) -> list[RewardResult]:
        name = getattr(fn, "__name__", repr(fn))
        limit = len(calls) * self.timeout_s  # the soft timeouts of all the calls, back to back
        # What ends a sandboxed execution early, named in its reason.
        sandbox = (f"reward call's time ({self.timeout_key or 'timeout_s'}={self.timeout_s:g} s)"
                   if self._wants_sandbox(fn) else None)

        def failed(why: str) -> list[RewardResult]:
            return [RewardResult(None, f"{name}: {why}") for _ in calls]

        for attempt in range(2):
            pool, board = self._get_pool()
            token = next(self._tokens)
            try:
                cfut = pool.submit(_run_with_alarm, fn, self.timeout_s, calls, item_fields, self._label, token, sandbox)
            except RuntimeError:  # the pool was shut down (recycled or closed) between get and submit
                if self._closed:
                    raise RewardRunnerClosed("the reward runner is closed") from None
                continue
            try:
                outcomes = await self._result_in_time(asyncio.wrap_future(cfut), board, token, limit)
            except TimeoutError:  # past every soft timeout and the grace: the worker is stuck for good
                self._recycle(pool)
                if board.started_at(token) is None:
                    return failed(f"no reward worker took the call up within {self.start_timeout_s:g}s "
                                  "(workers killed)")
                return failed(f"timed out after {self.timeout_s:g}s{self._label} (worker killed)")
            except asyncio.CancelledError:
                # Our own task cancelled: propagate. Otherwise the pool was retired because of
                # another call while this one still waited in it (`shutdown(cancel_futures=True)`
                # cancels those): it never ran, so it runs on the fresh pool.
                task = asyncio.current_task()
                if not cfut.cancelled() or (task is not None and task.cancelling()):
                    raise
                if self._closed:
                    raise RewardRunnerClosed("the reward runner was closed during the call") from None
                if attempt == 0:
                    continue
                return failed("reward worker pool unavailable (recycled twice)")
            except BrokenProcessPool:
                # The pool was retired because of another call. A victim that had not yet used its
                # time is retried once; one that ran past its timeout was stuck too: no retry.
                if self._closed:
                    raise RewardRunnerClosed("the reward runner was closed during the call") from None
                started = board.started_at(token)
                if attempt == 0 and (started is None or time.monotonic() - started < limit):
                    continue
                return failed("worker killed along with a stuck one")
            except Exception as exc:  # the worker could not run the calls (e.g. unpicklable arguments)
                return failed(f"{type(exc).__name__}: {exc}")
            return [_result(name, ok, value) for ok, value in outcomes]
        return failed("reward worker pool unavailable")

    def _wants_sandbox(self, fn: RewardFn) -> bool:
        try:
            return self._wants[fn]
        except KeyError:
            wants = self._wants[fn] = wants_sandbox(fn)
            return wants
        except TypeError:  # unhashable
            return wants_sandbox(fn)

    async def _result_in_time(self, fut: asyncio.Future, board: _StartBoard, token: int, limit: float) -> Any:
        """The call's result, or TimeoutError once it has run `limit + grace_s` since a worker took
        it up, or waited `start_timeout_s` for one to. Cancelling the caller cancels the call."""
        budget = limit + self.grace_s
        submitted = time.monotonic()
        while not fut.done():
            started = board.started_at(token)
            now = time.monotonic()
            left = (submitted + self.start_timeout_s if started is None else started + budget) - now
            if left <= 0:
                raise TimeoutError
            try:  # not started: look again after at most `budget`, which is then counted from the start
                await asyncio.wait({fut}, timeout=min(left, budget))
            except asyncio.CancelledError:
                fut.cancel()
                raise
        return fut.result()

    def close(self, grace_s: float = 1.0) -> None:
        """Stop the pool for good: idle workers exit at once, busy or stuck ones are killed after
        `grace_s` in total (not per worker), so closing never takes much longer than that. Calls
        after this raise `RewardRunnerClosed`. Idempotent."""
        with self._lock:
            self._closed = True
            pool, self._pool = self._pool, None
        if pool is None:
            return
        procs = list((getattr(pool, "_processes", None) or {}).values())
        pool.shutdown(wait=False, cancel_futures=True)
        deadline = time.monotonic() + grace_s
        for proc in procs:
            proc.join(timeout=max(0.0, deadline - time.monotonic()))
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                proc.join()

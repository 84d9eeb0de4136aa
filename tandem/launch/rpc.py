"""The controller side of a small, explicit RPC layer to an SPMD group of worker processes:
`WorkerGroup` and the errors its calls raise.

`WorkerGroup.call(Worker.method, ...)` runs the method on every rank and returns the results in
rank order (`call_per_rank`: each rank its own arguments); a method is named by the function on
the worker's class, never by a string. One call is in flight per group. A rank that dies or drops
its connection ends the call at once with `WorkerCrashedError`; after a crash, a deadline miss or
a rank left behind the group refuses further calls (`GroupBrokenError`): restart it. Wire format:
`rpc_wire.py`; worker side: `rpc_server.py`; details: docs/launch.md, "RPC"."""

from __future__ import annotations

import contextlib
import itertools
import os
import pickle
import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from multiprocessing.connection import Connection, wait
from types import FunctionType
from typing import Any, Protocol, TypeVar

from tandem.errors import TandemError
from tandem.launch.rpc_wire import OK, Channel, Failure, dumps, frames_nbytes

# Messages whose buffers add up to more than this are sent by per-rank threads (in parallel, and
# without blocking the wait for replies); smaller ones are written inline.
INLINE_SEND_BYTES = 1 << 20
R = TypeVar("R")


# The errors a `WorkerGroup` call raises.
class RPCError(TandemError, RuntimeError):
    """Base class of the errors a `WorkerGroup` call raises."""


class WorkerCrashedError(RPCError):
    """A worker process died or its connection dropped (during a call, or while idle)."""

    def __init__(self, group: str, rank: int, pid: int | None, status: str, log_tail: str, method: str | None):
        self.group, self.rank, self.pid, self.status, self.log_tail, self.method = (
            group, rank, pid, status, log_tail, method)
        during = f" during {method!r}" if method else " while idle"
        text = f"{group} worker rank {rank} (pid {pid}) crashed{during}: {status}"
        if log_tail:
            text += f"\n--- last lines of its log ---\n{log_tail.rstrip()}"
        super().__init__(text)


class RemoteError(RPCError):
    """A worker raised; `remote_traceback` is its formatted traceback, `exc_type` the class name.
    The original exception, when it could be pickled, is the `__cause__`."""

    def __init__(self, group: str, rank: int, method: str, exc_type: str, message: str, remote_traceback: str,
                 others: str = ""):
        self.group, self.rank, self.method = group, rank, method
        self.exc_type, self.message, self.remote_traceback = exc_type, message, remote_traceback
        text = f"{group} worker rank {rank} raised in {method!r}: {exc_type}: {message}{others}"
        text += f"\n--- remote traceback (rank {rank}) ---\n{remote_traceback.rstrip()}"
        super().__init__(text)


class RPCTimeoutError(RPCError, TimeoutError):
    """A call missed its deadline; `pending` are the ranks that had not answered."""

    def __init__(self, group: str, method: str, timeout_s: float, pending: Sequence[int]):
        self.group, self.method, self.timeout_s, self.pending = group, method, timeout_s, list(pending)
        super().__init__(f"{group}: {method!r} missed its {timeout_s:.1f}s deadline; no answer from "
                         f"rank(s) {self.pending}. The group is out of step and must be restarted.")


class GroupBrokenError(RPCError):
    """The group failed before (crash, deadline, ranks out of step) and takes no more calls."""


def method_name(method: Callable[..., Any]) -> str:
    """The name a request carries for `method`, a function defined on the served class
    (`TrainWorker.ping`); TypeError for anything else (a string, a bound method, a module-level
    function)."""
    if not isinstance(method, FunctionType) or "." not in method.__qualname__:
        raise TypeError(f"name a method by the function on the worker's class (e.g. Worker.ping), got {method!r}")
    return method.__name__

# ------------------------------------------------------------------------------- controller side


class WorkerProcess(Protocol):
    """What a `WorkerGroup` needs to know about each rank's process (a scheduler provides it)."""

    pid: int | None

    @property
    def sentinel(self) -> int:
        """A file descriptor that becomes readable when the process has ended."""
        ...

    def exit_status(self, wait_s: float = 0.0) -> str:
        """'exit code 3', 'killed by SIGKILL', or 'still running' (after waiting up to wait_s)."""
        ...

    def log_tail(self, lines: int = 40) -> str: ...


class _Waker:
    """A pipe that wakes the controller's wait; writes after `close` are dropped (never to a
    reused descriptor number)."""

    def __init__(self) -> None:
        self.fd, self._w = os.pipe()
        os.set_blocking(self._w, False)
        self._lock = threading.Lock()
        self._closed = False

    def wake(self) -> None:
        with self._lock, contextlib.suppress(OSError):
            if not self._closed:
                os.write(self._w, b"x")

    def drain(self) -> None:
        with self._lock, contextlib.suppress(OSError):
            if not self._closed:
                os.read(self.fd, 4096)

    def close(self) -> None:
        with self._lock:
            if not self._closed:
                self._closed = True
                os.close(self.fd)
                os.close(self._w)


class _Sender(threading.Thread):
    """Writes large messages to one rank, so ranks receive in parallel and the controller keeps
    watching for replies and crashes meanwhile. A failure wakes the controller via a pipe."""

    def __init__(self, conn: Channel, waker: _Waker, name: str):
        super().__init__(name=name, daemon=True)
        self.conn, self.waker = conn, waker
        self.jobs: queue.SimpleQueue[tuple[int, Sequence[Any]] | None] = queue.SimpleQueue()
        self.failed: tuple[int, BaseException] | None = None

    def run(self) -> None:
        while (job := self.jobs.get()) is not None:
            call_id, frames = job
            try:
                self.conn.send(frames)
            except BaseException as exc:
                self.failed = (call_id, exc)
                self.waker.wake()


class _Submitter(threading.Thread):
    """Runs submitted calls in order. A daemon: an unfinished call never holds up interpreter exit
    (unlike a ThreadPoolExecutor, whose threads are joined before atexit teardown could run)."""

    def __init__(self, name: str):
        super().__init__(name=name, daemon=True)
        self.jobs: queue.SimpleQueue[tuple[Future[Any], Callable[[], Any]] | None] = queue.SimpleQueue()

    def run(self) -> None:
        while (job := self.jobs.get()) is not None:
            future, fn = job
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn())
            except BaseException as exc:
                future.set_exception(exc)


class WorkerGroup:
    """Controller-side handle on N worker ranks. Calls are serialised (one in flight)."""

    def __init__(self, name: str, conns: Sequence[Connection], procs: Sequence[WorkerProcess], *,
                 default_timeout_s: float | None = None, error_grace_s: float = 5.0, log_tail_lines: int = 40):
        if len(conns) != len(procs):
            raise ValueError("one connection and one process per rank")
        self.name = name
        self.conns, self.procs = [Channel(c) for c in conns], list(procs)
        self.default_timeout_s, self.error_grace_s, self.log_tail_lines = default_timeout_s, error_grace_s, log_tail_lines
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._broken: BaseException | None = None
        self._closed = False
        self._waker = _Waker()
        self._senders = [_Sender(c, self._waker, f"tandem-rpc-{name}-{r}") for r, c in enumerate(self.conns)]
        for s in self._senders:
            s.start()
        self._submitter: _Submitter | None = None
        self.last_call_bytes = 0  # request bytes of the last call, all ranks together
        self.master_port: int | None = None  # the group's torch.distributed rendezvous port, when known
        self.hosts: list[str] = []  # each rank's address on the network it reaches the controller through

    @property
    def world_size(self) -> int:
        return len(self.conns)

    @property
    def pids(self) -> list[int | None]:
        return [p.pid for p in self.procs]

    @property
    def broken(self) -> BaseException | None:
        """The error that broke the group, or None while it is usable."""
        return self._broken

    # ---------------------------------------------------------------------------- public calls

    def call(self, method: Callable[..., R], *args: Any, rpc_timeout: float | None = None,
             **kwargs: Any) -> list[R]:
        """`method(*args, **kwargs)` on every rank (`method`: the function on the worker's class,
        e.g. `TrainWorker.ping`); results in rank order. `rpc_timeout` (seconds) overrides the
        group's default deadline (None: no deadline; crashes still end the call)."""
        name = method_name(method)
        call_id = next(self._ids)
        frames = dumps((call_id, name, args, kwargs))
        return self._run(name, call_id, [frames] * self.world_size, rpc_timeout)

    def call_per_rank(self, method: Callable[..., R], args_per_rank: Sequence[Sequence[Any]],
                      kwargs: dict[str, Any] | None = None, *, rpc_timeout: float | None = None) -> list[R]:
        """Rank r runs `method(*args_per_rank[r], **kwargs)`: each rank gets only its own data
        (e.g. its shard of the batch). Every rank must get an entry."""
        name = method_name(method)
        if len(args_per_rank) != self.world_size:
            raise ValueError(f"{self.name}: {len(args_per_rank)} argument tuples for {self.world_size} ranks")
        call_id = next(self._ids)
        per_rank = []
        for r, args in enumerate(args_per_rank):
            if not isinstance(args, tuple | list):
                raise TypeError(f"args_per_rank[{r}] must be a tuple of positional arguments, got {type(args).__name__}")
            per_rank.append(dumps((call_id, name, tuple(args), kwargs or {})))
        return self._run(name, call_id, per_rank, rpc_timeout)

    def submit(self, method: Callable[..., R], *args: Any, rpc_timeout: float | None = None,
               **kwargs: Any) -> Future[list[R]]:
        """`call` on a background (daemon) thread: a Future of the per-rank results. Submitted
        calls run one at a time in submission order."""
        method_name(method)  # a bad reference fails here, not on the thread
        future: Future[list[R]] = Future()
        if self._submitter is None:
            self._submitter = _Submitter(f"tandem-rpc-{self.name}-submit")
            self._submitter.start()
        self._submitter.jobs.put((future, lambda: self.call(method, *args, rpc_timeout=rpc_timeout, **kwargs)))
        return future

    def check(self) -> None:
        """Raise `WorkerCrashedError` if a rank has died while idle (non-blocking)."""
        with self._lock:
            self._raise_if_unusable()
            self._check_idle()

    def sentinels(self) -> list[int]:
        """Waitable objects (for `multiprocessing.connection.wait`) that fire when a rank dies."""
        return [p.sentinel for p in self.procs]

    def shutdown(self, timeout_s: float = 5.0) -> bool:
        """Ask every rank to leave (the served object's `shutdown()`, which returns
        `ExitAfterReply`) and wait for the processes to end. Returns True when all ended; never
        raises. A scheduler kills whatever is left afterwards."""
        ok = False
        # Never wait for the lock: shutdown may run from a signal handler that interrupted a call.
        if self._broken is None and not self._closed and self._lock.acquire(blocking=False):
            try:
                call_id = next(self._ids)
                frames = dumps((call_id, "shutdown", (), {}))
                self._run_locked("shutdown", call_id, [frames] * self.world_size, timeout_s)
                ok = True
            except Exception:
                ok = False
            finally:
                self._lock.release()
        alive = [p.sentinel for p in self.procs]
        end = time.monotonic() + timeout_s
        while ok and alive and (left := end - time.monotonic()) > 0:  # they were asked to leave
            for s in wait(alive, left):
                alive.remove(s)  # type: ignore[arg-type]
        self.close()
        return ok and not alive

    def close(self) -> None:
        """Close the connections (workers see EOF and leave) and stop the sender threads."""
        if self._closed:
            return
        self._closed = True
        if self._broken is None:
            self._broken = GroupBrokenError(f"{self.name}: the group was shut down")
        for s in self._senders:
            s.jobs.put(None)
        for c in self.conns:
            c.close()
        if self._submitter is not None:
            self._submitter.jobs.put(None)
        self._waker.close()

    # -------------------------------------------------------------------------------- internals

    def _raise_if_unusable(self) -> None:
        if self._broken is not None:
            raise GroupBrokenError(f"{self.name}: the group cannot take calls any more: {self._broken}") from self._broken

    def _crash(self, rank: int, method: str | None) -> WorkerCrashedError:
        proc = self.procs[rank]
        status = proc.exit_status(wait_s=2.0)
        if status == "still running":
            status = "its connection dropped while the process is still running"
        err = WorkerCrashedError(self.name, rank, proc.pid, status, proc.log_tail(self.log_tail_lines), method)
        self._broken = err
        return err

    def _check_idle(self) -> None:
        watch: dict[Any, int] = {}
        for r, (c, p) in enumerate(zip(self.conns, self.procs, strict=True)):
            watch[c] = r
            watch[p.sentinel] = r
        ready = wait(list(watch), 0)
        if ready:  # nothing may arrive between calls: a readable connection is EOF, a sentinel a death
            raise self._crash(min(watch[o] for o in ready), None)

    def _run(self, method: str, call_id: int, frames_per_rank: Sequence[Sequence[Any]],
             rpc_timeout: float | None) -> list[Any]:
        timeout = self.default_timeout_s if rpc_timeout is None else rpc_timeout
        with self._lock:
            return self._run_locked(method, call_id, frames_per_rank, timeout)

    def _run_locked(self, method: str, call_id: int, frames_per_rank: Sequence[Sequence[Any]],
                    timeout: float | None) -> list[Any]:
        self._raise_if_unusable()
        self._check_idle()
        self.last_call_bytes = sum(frames_nbytes(f) for f in frames_per_rank)
        for r, frames in enumerate(frames_per_rank):
            if frames_nbytes(frames) <= INLINE_SEND_BYTES:
                try:
                    self.conns[r].send(frames)
                except OSError:
                    raise self._crash(r, method) from None
            else:
                self._senders[r].jobs.put((call_id, frames))
        return self._collect(method, call_id, timeout)

    def _collect(self, method: str, call_id: int, timeout: float | None) -> list[Any]:
        n = self.world_size
        start = time.monotonic()
        deadline = None if timeout is None else start + timeout
        results: list[Any] = [None] * n
        pending = set(range(n))
        errors: dict[int, Failure] = {}
        grace_end: float | None = None
        while pending:
            now = time.monotonic()
            ends = [t for t in (deadline, grace_end) if t is not None]
            left = None if not ends else max(0.0, min(ends) - now)
            watch: dict[Any, int] = {self._waker.fd: -1}
            for r in pending:
                watch[self.conns[r]] = r
                watch[self.procs[r].sentinel] = r
            ready = wait(list(watch), left)
            if not ready:
                if errors:
                    self._broken = RPCError(f"{self.name}: rank(s) {sorted(pending)} still inside {method!r} "
                                            "after another rank raised; the group is out of step")
                    raise self._remote_error(method, errors, pending)
                self._broken = RPCTimeoutError(self.name, method, timeout or 0.0, sorted(pending))
                raise self._broken
            # Replies first: a rank that answered and then exited is not a crash of this call.
            for obj in sorted(ready, key=lambda o: isinstance(o, int)):
                rank = watch[obj]
                if rank == -1:
                    self._raise_send_failure(method)
                    continue
                if rank not in pending:
                    continue
                conn = self.conns[rank]
                if isinstance(obj, int) and not conn.poll(0):
                    raise self._crash(rank, method)
                try:
                    reply_id, status, value = conn.recv()
                except (EOFError, OSError):
                    raise self._crash(rank, method) from None
                if reply_id != call_id:
                    self._broken = RPCError(f"{self.name}: rank {rank} answered call {reply_id}, expected {call_id}")
                    raise self._broken
                pending.discard(rank)
                if status == OK:
                    results[rank] = value
                else:
                    errors[rank] = value
                    if grace_end is None:
                        grace_end = time.monotonic() + self.error_grace_s
        if errors:
            raise self._remote_error(method, errors, ())
        return results

    def _raise_send_failure(self, method: str) -> None:
        self._waker.drain()
        for r, s in enumerate(self._senders):
            if s.failed is not None:
                s.failed = None
                raise self._crash(r, method)

    def _remote_error(self, method: str, errors: dict[int, Failure], stuck: Sequence[int]) -> RemoteError:
        rank = min(errors)
        f = errors[rank]
        others = ""
        if len(errors) > 1:
            others += f" (rank(s) {sorted(errors)[1:]} raised too)"
        if stuck:
            others += f" (rank(s) {sorted(stuck)} never answered; the group is out of step and must be restarted)"
        err = RemoteError(self.name, rank, method, f.exc_type, f.message, f.traceback, others)
        if f.exc is not None:
            with contextlib.suppress(Exception):
                err.__cause__ = pickle.loads(f.exc)
        return err

    def __repr__(self) -> str:
        state = "broken" if self._broken else "ok"
        return f"WorkerGroup({self.name!r}, world_size={self.world_size}, pids={self.pids}, {state})"

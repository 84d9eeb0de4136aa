"""The errors a `WorkerGroup` call raises (`rpc.py`); all are `RPCError`s."""

from __future__ import annotations

from collections.abc import Sequence

from tandem.errors import TandemError


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

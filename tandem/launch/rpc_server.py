"""The worker side of the RPC layer: a worker process's life, and serving one object.

`serve_from_environment(build)` is the whole life of a worker process a scheduler started: CPU
pinning, parent-death signal, the run's RPC key taken out of the environment, the rendezvous,
`build()` (the rank says ready only after it), then serving until the controller disconnects or a
method returns `ExitAfterReply`, and `os._exit(0)`. `serve(conn, obj)` answers requests with `obj`'s
public methods, one at a time, in the calling thread. Controller side: `rpc.py`."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, NoReturn

from tandem.launch.affinity import apply_cpu_affinity_from_env
from tandem.launch.guard import die_with_parent
from tandem.launch.rendezvous import ENV_CONNECT, READY, join_controller
from tandem.launch.rpc_wire import ERR, OK, Channel, dumps, failure_of

# What a scheduler puts in a worker's environment (read by `serve_from_environment`), besides RANK,
# WORLD_SIZE, LOCAL_RANK and `rendezvous.ENV_CONNECT`.
ENV_AUTHKEY = "TANDEM_RPC_AUTHKEY"  # hex of the run's key; removed from the environment once read
ENV_PLACEMENT = "TANDEM_PLACEMENT"  # the scheduler's words for where the rank runs (e.g. "job 12.0")
ENV_PARENT_PID = "TANDEM_PARENT_PID"  # the controller: SIGKILL when it dies
ENV_NAME = "TANDEM_RPC_NAME"  # the process's name in its log lines (e.g. actor-rank0)


def worker_pid(name: str, parent: int) -> int | None:
    """The pid of the worker that the controller `parent` started under the name `name` (e.g.
    actor-rank1) on this machine, read from /proc (Linux); None when there is none. For tests and
    benchmarks that kill one rank of a run."""
    wanted = {f"{ENV_NAME}={name}".encode(), f"{ENV_PARENT_PID}={parent}".encode()}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            env = set((entry / "environ").read_bytes().split(b"\0"))
        except OSError:
            continue
        if wanted <= env:
            return int(entry.name)
    return None


@dataclass
class ExitAfterReply:
    """Return this from a served method to send `value` and then leave the serve loop."""

    value: Any = None


def serve(conn: Connection, obj: Any) -> None:
    """Answer requests on `conn` with `obj`'s public methods until the controller disconnects or
    a method returns `ExitAfterReply`. Runs in the calling (main) thread."""
    channel = Channel(conn)
    while True:
        try:
            call_id, method, args, kwargs = channel.recv()
        except (EOFError, OSError):
            return  # the controller is gone
        leave = False
        try:
            if method.startswith("_"):
                raise AttributeError(f"{method!r} is private; only public methods are served")
            fn = getattr(obj, method, None)
            if not callable(fn):
                raise AttributeError(f"{type(obj).__name__} has no method {method!r}")
            value = fn(*args, **kwargs)
            if isinstance(value, ExitAfterReply):
                value, leave = value.value, True
            try:
                reply = dumps((call_id, OK, value))
            except Exception as exc:
                raise TypeError(f"the result of {method!r} cannot be sent: {exc}") from exc
        except BaseException as exc:  # reported to the controller, which decides
            reply = dumps((call_id, ERR, failure_of(exc)))
            if isinstance(exc, SystemExit | KeyboardInterrupt):
                leave = True
        try:
            channel.send(reply)
        except OSError:
            return
        if leave:
            return


def serve_from_environment(build: Callable[[], object]) -> NoReturn:
    """Run a worker process as the module docstring says: `build()` makes the object to serve.
    An exception from `build` ends the process with it (the scheduler reports a failed start)."""
    apply_cpu_affinity_from_env()
    if (parent := os.environ.get(ENV_PARENT_PID)) is not None:
        die_with_parent(int(parent))
    authkey = bytes.fromhex(os.environ.pop(ENV_AUTHKEY))
    name = os.environ.get(ENV_NAME, f"worker-{os.getpid()}")
    conn = join_controller(os.environ.pop(ENV_CONNECT), authkey, int(os.environ["RANK"]),
                           os.environ.get(ENV_PLACEMENT, ""))
    obj = build()
    conn.send(READY)
    print(f"{name}: pid {os.getpid()}, {obj}: serving RPC", flush=True)
    try:
        serve(conn, obj)
    finally:
        print(f"{name}: leaving", flush=True)
        sys.stdout.flush()
        sys.stderr.flush()
        # Not a normal exit: interpreter teardown after collectives sometimes aborts (the reply is sent).
        os._exit(0)

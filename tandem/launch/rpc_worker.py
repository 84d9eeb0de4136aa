"""The worker side of the RPC layer: `serve(conn, obj)` answers the controller's requests with
`obj`'s public methods, one at a time, in the worker's main thread (see `rpc.py` for the
controller side, `rpc_wire.py` for the messages).
"""

from __future__ import annotations

from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from tandem.launch.rpc_wire import ERR, OK, Channel, dumps, failure_of


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


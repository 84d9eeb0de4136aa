"""Fault injection for the weight routes, a testing aid: `install` mounts the hidden `POST /_fault`
route and returns the `FaultInjector` the weight routes consult, only with `TANDEM_FAULT_INJECTION=1`
in the server's environment (otherwise nothing is installed: `/_fault` is a 404 like any unknown
path and the routes consult nothing). A fault set on a route makes its `nth` call (counted from
when it was set) and the `times - 1` after it answer 500, raise an unexpected exception (a bug's
stand-in), hang `seconds` and answer 503, SIGKILL the server (on /update_weights_from_distributed
optionally after receiving `after_tensors` tensors: the receive applies it), or SIGSTOP it (the
whole process freezes, health route included, as a hung host or a partition would). `{"clear": true}`
removes all faults.
"""

from __future__ import annotations

import asyncio
import os
import signal
from dataclasses import dataclass

from fastapi import FastAPI, Request
from starlette.responses import Response

from tandem.inference.server.http_api import ApiError, check_fields, control_response, get_field, read_json

FAULT_ENV = "TANDEM_FAULT_INJECTION"
FAULT_ROUTES = ("update_weights_from_disk", "init_weights_update_group", "update_weights_from_distributed",
                "update_weights_from_shm", "commit_staged_weights", "discard_staged_weights",
                "destroy_weights_update_group")
FAULT_ACTIONS = ("500", "error", "hang", "kill", "stop")


@dataclass
class Fault:
    # "500": answer 500; "error": raise RuntimeError; "hang": wait `seconds`, then 503; "kill": SIGKILL;
    # "stop": SIGSTOP (the test sends SIGCONT)
    action: str
    nth: int = 1  # first call (1-based, counted from when the fault was set) that fails
    times: int = 1  # how many calls fail from there on
    seconds: float = 30.0
    after_tensors: int | None = None  # kill on update_weights_from_distributed: after this many tensors
    calls: int = 0


class FaultInjector:
    """The faults set through `/_fault`, by route name."""

    def __init__(self) -> None:
        self.faults: dict[str, Fault] = {}

    async def hit(self, route: str) -> Fault | None:
        """The fault set for `route`, applied when this call is one it hits (else None)."""
        fault = self.faults.get(route)
        if fault is None:
            return None
        fault.calls += 1
        if not fault.nth <= fault.calls < fault.nth + fault.times:
            return None
        if fault.action == "500":
            raise ApiError(f"injected fault on /{route}", 500)
        if fault.action == "error":
            raise RuntimeError(f"injected bug on /{route}")
        if fault.action == "hang":
            await asyncio.sleep(fault.seconds)
            raise ApiError(f"injected fault on /{route}: hung for {fault.seconds}s", 503)
        if fault.action == "stop":
            os.kill(os.getpid(), signal.SIGSTOP)
            return None  # continued: the call goes on as if nothing happened
        if fault.after_tensors is None or route != "update_weights_from_distributed":
            os.kill(os.getpid(), signal.SIGKILL)
        return fault

    async def set_fault(self, request: Request) -> Response:
        """`POST /_fault`: `{"route": "update_weights_from_distributed", "action": "500"|"error"|"hang"|"kill"|"stop",
        "nth"?, "times"?, "seconds"?, "after_tensors"?}` makes that route fail; `{"clear": true}`
        removes all faults."""
        body = await read_json(request, allow_empty=False)
        check_fields(body, {"route", "action", "nth", "times", "seconds", "after_tensors", "clear"})
        if get_field(body, "clear", bool, False):
            self.faults.clear()
            return control_response(True, "faults cleared")
        route = get_field(body, "route", str, required=True)
        action = get_field(body, "action", str, required=True)
        if route not in FAULT_ROUTES or action not in FAULT_ACTIONS:
            raise ApiError(f"route must be one of {list(FAULT_ROUTES)} and action one of {', '.join(FAULT_ACTIONS)}")
        self.faults[route] = Fault(action, nth=get_field(body, "nth", int, 1), times=get_field(body, "times", int, 1),
                                   seconds=float(get_field(body, "seconds", float, 30.0)),
                                   after_tensors=get_field(body, "after_tensors", int))
        return control_response(True, f"fault set on /{route}: {action}")


def install(app: FastAPI) -> FaultInjector | None:
    """With `TANDEM_FAULT_INJECTION=1`: mount `POST /_fault` on `app` and return the injector the
    weight routes consult (`ServerState.faults`); otherwise install nothing and return None."""
    if os.environ.get(FAULT_ENV) != "1":
        return None
    injector = FaultInjector()
    app.add_api_route("/_fault", injector.set_fault, methods=["POST"])
    return injector

"""The rollout controller's callback server: a FastAPI app under uvicorn on an event loop of its
own, in a daemon thread, that trainer workers (`RolloutCallback`), rollout worker processes,
`tandem fleet` and joining servers reach over HTTP. Control plane only.

Every route needs `Authorization: Bearer <secret>` (constant-time comparison); `GET /fleet/members`
and `POST /fleet/join` also take the join token; 401 otherwise. Fleet operations are awaited as
futures, so a long transfer never blocks a worker's report. The routes: docs/rollout.md,
"Controller and callbacks"."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from starlette.responses import JSONResponse
from starlette.types import ASGIApp

from tandem.aio import new_event_loop
from tandem.fleet.http import normalize_address
from tandem.fleet.ops import OPS, FleetOp
from tandem.fleet.results import FleetError, FleetResult
from tandem.fleet.wire import WireError, from_json, to_json
from tandem.http_auth import BearerAuth
from tandem.rollout.asgi_server import EventServer, listen_socket
from tandem.rollout.workers import EPISODE_ROUTE, READY_ROUTE

if TYPE_CHECKING:
    from tandem.rollout.controller import RolloutController


def build_app(ctl: RolloutController) -> ASGIApp:
    """The callback routes over `ctl` (its Fleet methods, `fleet_info()`, its membership and
    rollout workers), behind the bearer check with `ctl.secret` (and `ctl.join_token`)."""
    app = FastAPI(title="tandem rollout controller", docs_url=None, redoc_url=None, openapi_url=None)

    async def body_of(request: Request) -> dict[str, Any]:
        try:
            data = await request.json()
        except ValueError:
            data = None
        if not isinstance(data, dict):
            raise _BadRequest("the body must be a JSON object")
        return data

    def fleet_route(op: FleetOp):
        async def handler(request: Request) -> JSONResponse:
            body = await body_of(request)
            try:
                fleet_request = from_json(op.request, body.get("request"), "body.request")
                targets = from_json(tuple[str, ...] | None, body.get("targets"), "body.targets")
            except WireError as exc:
                raise _BadRequest(f"/fleet/{op.name}: {exc}") from exc
            try:
                result = await asyncio.wrap_future(ctl.send(op, fleet_request, targets))
            except FleetError as exc:
                result = FleetResult(exc.phase, exc.failures)
            except Exception as exc:  # e.g. an operation these servers do not support
                return JSONResponse({"success": False, "message": f"{type(exc).__name__}: {exc}"}, 422)
            return JSONResponse(to_json(result))

        return handler

    for op in OPS.values():
        app.add_api_route(f"/fleet/{op.name}", fleet_route(op), methods=["POST"])

    @app.get("/fleet/info")
    async def info() -> JSONResponse:
        return JSONResponse(ctl.fleet_info())

    @app.get("/fleet/topology")
    async def topology() -> JSONResponse:
        return JSONResponse(to_json(ctl.topology()))

    @app.post("/fleet/admit")
    async def admit(request: Request) -> JSONResponse:
        body = await body_of(request)
        try:
            addresses = from_json(tuple[str, ...], body.get("addresses"), "body.addresses")
            version = from_json(int, body.get("version"), "body.version")
        except WireError as exc:
            raise _BadRequest(f"/fleet/admit: {exc}") from exc
        ctl.admit(addresses, version)
        return JSONResponse({"success": True})

    @app.get(MEMBERS_ROUTE)
    async def members() -> JSONResponse:
        return JSONResponse(ctl.members())

    @app.post(JOIN_ROUTE)
    async def join(request: Request) -> JSONResponse:
        body = await body_of(request)
        try:
            address = normalize_address(from_json(str, body.get("address"), "body.address"))
            pid = from_json(int | None, body.get("pid"), "body.pid")
            devices = from_json(int, body.get("devices", 1), "body.devices")
        except WireError as exc:
            raise _BadRequest(f"{JOIN_ROUTE}: {exc}") from exc
        if devices < 1:
            raise _BadRequest(f"{JOIN_ROUTE}: body.devices must be at least 1, got {devices}")
        return JSONResponse({"success": True, "state": ctl.join(address, pid, devices=devices)})

    @app.post(EPISODE_ROUTE)
    async def episode(request: Request) -> JSONResponse:
        data = await body_of(request)
        if ctl.workers is None:
            raise _BadRequest("this controller has no rollout workers")
        try:
            known = ctl.workers.report(data)
        except (KeyError, TypeError, ValueError) as exc:
            raise _BadRequest(f"bad episode report: {type(exc).__name__}: {exc}") from exc
        if not known:
            return JSONResponse({"success": False, "message": "no episode waits for this task"}, 404)
        return JSONResponse({"success": True})

    @app.post(READY_ROUTE)
    async def worker_ready(request: Request) -> JSONResponse:
        data = await body_of(request)
        if ctl.workers is not None:
            ctl.workers.mark_ready(int(data.get("worker", -1)))
        return JSONResponse({"success": True})

    @app.exception_handler(_BadRequest)
    async def bad_request(request: Request, exc: _BadRequest) -> JSONResponse:
        return JSONResponse({"success": False, "message": str(exc)}, 400)

    denied = JSONResponse({"success": False, "message": "missing or wrong callback secret"}, 401)
    return BearerAuth(app, ctl.secret, denied, also=dict.fromkeys(_JOIN_TOKEN_ROUTES, ctl.join_token))


MEMBERS_ROUTE = "/fleet/members"
JOIN_ROUTE = "/fleet/join"
_JOIN_TOKEN_ROUTES = {MEMBERS_ROUTE, JOIN_ROUTE}


class _BadRequest(Exception):
    pass


class CallbackServer:
    """The callback app served by uvicorn on its own event loop, in a daemon thread."""

    def __init__(self, app: ASGIApp, host: str, port: int):
        self.sock, self.address = listen_socket(host, port)
        self.port = self.sock.getsockname()[1]
        self.server = EventServer(app)
        self.loop = new_event_loop()
        self.thread = threading.Thread(target=self._run, name="tandem-rollout-callbacks", daemon=True)
        self._error: BaseException | None = None

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_until_complete(self.server.serve(sockets=[self.sock]))
        except BaseException as exc:  # reported by start()
            self._error = exc
            self.server.started_event.set()
        finally:
            self.loop.run_until_complete(self.loop.shutdown_asyncgens())
            self.loop.close()

    def start(self, timeout: float = 30.0) -> None:
        self.thread.start()
        if not self.server.started_event.wait(timeout) or self._error is not None or not self.server.started:
            raise RuntimeError(f"the rollout callback server did not start: {self._error!r}")

    def stop(self, timeout: float = 10.0) -> None:
        if self.thread.is_alive():
            with contextlib.suppress(RuntimeError):
                self.loop.call_soon_threadsafe(self.server.request_stop)
            self.thread.join(timeout)
        self.sock.close()


"""`RolloutController`: the rollout side of the controller process.

It owns the fleet as the rollout side sees it (the `ServerPool` and its `InferenceClient`), the
`WorkflowExecutor` (episodes, the one `StalenessManager`), optional rollout worker processes, and a
small HTTP callback server on 127.0.0.1 that other processes reach with the run's secret
(`Authorization: Bearer <secret>`; 401 otherwise):

| route | caller | effect |
|---|---|---|
| `POST /fleet/{op}` | `RolloutCallback` in trainer workers | fleet operation fanned out to every server; answers the per-server `FleetResult` |
| `GET /fleet/info` | `RolloutCallback.world_size` | servers, health, world size, version |
| `POST /rollout/episode` | rollout worker processes | one finished episode; resolves the future its executor slot awaits |
| `POST /rollout/worker_ready` | rollout worker processes | a worker is up |

The controller is also a `Fleet` itself (same methods), for a trainer that lives in the controller
process. Around a weight update the fleet operations keep protocol.md section 5 step 4 in order:
`pause_generation` stops the dispatch of new episodes and then pauses the servers (in-flight requests
come back with their partial output and wait); `set_version(v)` tells the servers and then the
executor (capacity grows); `continue_generation` releases the servers and then resumes dispatch.

The fan-out itself is `tandem.weights.http_fleet.HttpFleet` over the pool's servers (one
implementation for direct and controller-mediated fleets). Nothing polls: the callback server is
uvicorn on an event loop of its own whose main loop waits on an event (uvicorn's stock one wakes
every 0.1 s), fleet calls are awaited HTTP requests, and waiting callers block on futures and
conditions.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import logging
import secrets
import socket
import threading
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from tandem.data.trajectory import Trajectory
from tandem.errors import ConfigError
from tandem.rollout.callback import (
    RolloutCallback,
    bucket_from_json,
    meta_from_json,
    result_to_json,
    spec_from_json,
)
from tandem.rollout.client import InferenceClient
from tandem.rollout.config import RolloutConfig
from tandem.rollout.executor import WorkflowExecutor
from tandem.rollout.pool import ServerPool
from tandem.rollout.workers import EPISODE_ROUTE, READY_ROUTE, RemoteWorkflow, WorkerPool
from tandem.rollout.workflow import RolloutWorkflow
from tandem.weights.fleet import FleetError, FleetResult, ServerChecksums
from tandem.weights.http_fleet import HttpFleet
from tandem.weights.meta import Deadlines, ParamSpec, ShmBucket, WeightUpdateMeta

logger = logging.getLogger(__name__)

# Phases after which a failing server is taken out of routing: it may be paused, or serve old weights.
_UNHEALTHY_ON_FAILURE = {"pause_generation", "continue_generation", "update_weights_from_disk",
                         "update_weights_from_distributed", "update_weights_from_shm", "commit_weights", "set_version"}
# The Fleet operations the callback server forwards: POST /fleet/{op}.
FLEET_OPS = ("pause_generation", "continue_generation", "set_version", "init_weights_update_group",
             "update_weights_from_distributed", "update_weights_from_shm", "destroy_weights_update_group",
             "update_weights_from_disk", "commit_weights", "discard_weights", "weight_checksums")


class RolloutController:
    def __init__(self, config: RolloutConfig, secret: str | None = None, deadlines: Deadlines | None = None,
                 start: bool = True):
        config.check()
        if not config.servers:
            raise ConfigError("the rollout controller needs server addresses (rollout.servers); for a tandem "
                              "backend the launcher fills them in after starting the servers")
        self.config = config
        self.secret = secret or secrets.token_urlsafe(32)
        self.pool = ServerPool(config.servers)
        self.client = InferenceClient(self.pool, config.client_config())
        self.executor = WorkflowExecutor(self.client, config.executor_config())
        self.deadlines = deadlines or Deadlines(http_s=config.control_timeout_s)
        self._fleet: HttpFleet | None = None
        self._old_fleets: list[HttpFleet] = []
        self.workers: WorkerPool | None = None
        self._remote: dict[int, tuple[RolloutWorkflow, RemoteWorkflow]] = {}
        self._lock = threading.Lock()
        self._driver_paused = False
        self._fleet_paused = False
        self._server: _CallbackServer | None = None
        self._closed = False
        if start:
            self.start()

    # -- lifecycle ----------------------------------------------------------------------------------
    def start(self) -> RolloutController:
        if self._server is not None:
            return self
        self._server = _CallbackServer(self._build_app(), self.config.callback_host, self.config.callback_port)
        self._server.start()
        if self.config.workers > 0:
            self.workers = WorkerPool(self.config.workers, self.pool.addresses, self.config.client_config(),
                                      self.callback_address(), self.secret)
            self.workers.start()
            try:
                self.workers.wait_ready(self.config.worker_start_timeout_s)
            except BaseException:
                self.shutdown()
                raise
        return self

    def callback_address(self) -> str:
        if self._server is None:
            raise RuntimeError("the controller's callback server is not started")
        return self._server.address

    def callback(self) -> RolloutCallback:
        """A `RolloutCallback` for trainer workers (picklable; or pass `callback().env()`)."""
        return RolloutCallback(self.callback_address(), self.secret, self.config.control_timeout_s + 30)

    def shutdown(self, timeout: float = 10.0) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self.executor.shutdown(timeout)
        finally:
            if self.workers is not None:
                self.workers.shutdown(timeout)
            if self._server is not None:
                self._server.stop(timeout)
            for fleet in [*self._old_fleets, *([self._fleet] if self._fleet is not None else [])]:
                with contextlib.suppress(Exception):
                    fleet.close()

    def __enter__(self) -> RolloutController:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # -- the executor, for the driver ---------------------------------------------------------------
    @property
    def version(self) -> int:
        return self.executor.version

    def submit(self, item: Any, workflow: RolloutWorkflow) -> None:
        self.executor.submit(item, self._workflow(workflow))

    def wait(self, count: int, timeout: float | None = None) -> list[Trajectory]:
        return self.executor.wait(count, timeout)

    def rollout_batch(self, items: Iterable[Any], workflow: RolloutWorkflow, timeout: float | None = None) -> list[Trajectory]:
        return self.executor.rollout_batch(items, self._workflow(workflow), timeout)

    def prepare_batch(self, dataloader: Iterable[Any], workflow: RolloutWorkflow, batch_size: int | None = None,
                      timeout: float | None = None) -> list[Trajectory]:
        return self.executor.prepare_batch(dataloader, self._workflow(workflow), batch_size, timeout)

    def pause(self) -> None:
        """Stop dispatching new episodes (running ones go on) until `resume`."""
        with self._lock:
            self._driver_paused = True
            self._sync_dispatch()

    def resume(self) -> None:
        with self._lock:
            self._driver_paused = False
            self._sync_dispatch()

    def recover_version(self, version: int) -> None:
        self.executor.recover_version(version)
        if self.workers is not None:
            self.workers.set_version(version)

    def stats(self) -> dict[str, Any]:
        out = self.executor.stats()
        out["servers"] = [{"address": s.address, "healthy": s.healthy, "outstanding": s.outstanding}
                          for s in self.pool.snapshot()]
        return out

    # -- Fleet (a trainer in this process calls these; trainer workers reach them via RolloutCallback) --
    @property
    def world_size(self) -> int:
        return self.fleet().world_size

    def pause_generation(self) -> FleetResult:
        """Stop dispatching new episodes, then pause every server (in-flight requests come back
        with their partial output and wait in the server)."""
        with self._lock:
            self._fleet_paused = True
            self._sync_dispatch()
        return self._checked("pause_generation", lambda f: f.pause_generation())

    def continue_generation(self) -> FleetResult:
        """Release the servers, then resume dispatch (unless the driver paused it)."""
        try:
            return self._checked("continue_generation", lambda f: f.continue_generation())
        finally:
            with self._lock:
                self._fleet_paused = False
                self._sync_dispatch()

    def set_version(self, version: int) -> FleetResult:
        """Tell the servers (the version they echo), then the executor (its capacity grows): an
        episode that starts at version v only ever meets weights >= v."""
        try:
            return self._checked("set_version", lambda f: f.set_version(version))
        finally:
            self.executor.set_version(version)
            if self.workers is not None:
                self.workers.set_version(version)

    def init_weights_update_group(self, meta: WeightUpdateMeta) -> Future[FleetResult]:
        return self._checked("init_weights_update_group", lambda f: f.init_weights_update_group(meta))

    def update_weights_from_distributed(self, meta: WeightUpdateMeta, specs: Sequence[ParamSpec], *,
                                        commit: bool = True, bucket_index: int | None = None) -> Future[FleetResult]:
        return self._checked("update_weights_from_distributed", lambda f: f.update_weights_from_distributed(
            meta, specs, commit=commit, bucket_index=bucket_index))

    def update_weights_from_shm(self, meta: WeightUpdateMeta, bucket: ShmBucket, *, commit: bool = True,
                                bucket_index: int | None = None) -> Future[FleetResult]:
        return self._checked("update_weights_from_shm", lambda f: f.update_weights_from_shm(
            meta, bucket, commit=commit, bucket_index=bucket_index))

    def destroy_weights_update_group(self, meta: WeightUpdateMeta) -> FleetResult:
        return self._checked("destroy_weights_update_group", lambda f: f.destroy_weights_update_group(meta))

    def update_weights_from_disk(self, meta: WeightUpdateMeta, *, commit: bool = True) -> Future[FleetResult]:
        return self._checked("update_weights_from_disk", lambda f: f.update_weights_from_disk(meta, commit=commit))

    def commit_weights(self, meta: WeightUpdateMeta) -> FleetResult:
        return self._checked("commit_weights", lambda f: f.commit_weights(meta))

    def discard_weights(self, meta: WeightUpdateMeta) -> FleetResult:
        return self._checked("discard_weights", lambda f: f.discard_weights(meta))

    def weight_checksums(self, names: Sequence[str] | None = None) -> dict[str, ServerChecksums]:
        return self._checked("weight_checksums", lambda f: f.weight_checksums(names))

    def fleet(self) -> HttpFleet:
        """The `HttpFleet` over the pool's current servers (rebuilt when the membership changed)."""
        addresses = self.pool.addresses
        with self._lock:
            if self._fleet is None or self._fleet.addresses != addresses:
                if self._fleet is not None:
                    self._old_fleets.append(self._fleet)  # calls may be in flight on it: closed at shutdown
                self._fleet = HttpFleet(addresses, api_key=self.config.api_key, deadlines=self.deadlines)
            return self._fleet

    def _checked(self, op: str, call: Callable[[HttpFleet], Any]) -> Any:
        """Run one fleet call; a server that fails it is logged and, where it may now be paused or
        serve other weights, taken out of routing. Futures get the same treatment when they fail."""
        try:
            out = call(self.fleet())
        except FleetError as exc:
            self._on_failure(op, exc)
            raise
        if isinstance(out, Future):

            def done(fut: Future) -> None:
                exc = None if fut.cancelled() else fut.exception()
                if isinstance(exc, FleetError):
                    self._on_failure(op, exc)

            out.add_done_callback(done)
        return out

    def _on_failure(self, op: str, exc: FleetError) -> None:
        for failure in exc.failures:
            logger.error("fleet %s (%s) failed on %s: %s", op, exc.phase, failure.address, failure.message)
            if op in _UNHEALTHY_ON_FAILURE:
                self.pool.mark_unhealthy(failure.address)

    # -- internals ----------------------------------------------------------------------------------
    def _sync_dispatch(self) -> None:  # under self._lock
        if self._driver_paused or self._fleet_paused:
            self.executor.pause()
        else:
            self.executor.resume()

    def _workflow(self, workflow: RolloutWorkflow) -> RolloutWorkflow:
        if self.workers is None:
            return workflow
        with self._lock:
            entry = self._remote.get(id(workflow))
            if entry is None or entry[0] is not workflow:
                entry = self._remote[id(workflow)] = (workflow, RemoteWorkflow(self.workers, workflow))
            return entry[1]

    # -- the callback server's app -------------------------------------------------------------------
    def _build_app(self) -> ASGIApp:
        app = FastAPI(title="tandem rollout controller", docs_url=None, redoc_url=None, openapi_url=None)

        async def body_of(request: Request) -> dict[str, Any]:
            try:
                data = await request.json()
            except ValueError:
                data = None
            if not isinstance(data, dict):
                raise _BadRequest("the body must be a JSON object")
            return data

        def fleet_route(op: str):
            async def handler(request: Request) -> JSONResponse:
                data = await body_of(request)
                try:
                    call = self._fleet_call(op, data)
                except (KeyError, TypeError, ValueError) as exc:
                    raise _BadRequest(f"/fleet/{op}: bad body: {type(exc).__name__}: {exc}") from exc
                try:
                    out = await asyncio.to_thread(call)  # blocking fleet calls run off this loop
                    if isinstance(out, Future):
                        out = await asyncio.wrap_future(out)
                except FleetError as exc:
                    return JSONResponse(result_to_json(FleetResult(exc.phase, exc.failures)))
                if op == "weight_checksums":
                    return JSONResponse({"phase": "get_weights_checksum", "results": [],
                                         "checksums": {a: dataclasses.asdict(c) for a, c in out.items()}})
                return JSONResponse(result_to_json(out))

            return handler

        for op in FLEET_OPS:
            app.add_api_route(f"/fleet/{op}", fleet_route(op), methods=["POST"])

        @app.get("/fleet/info")
        async def info() -> JSONResponse:
            return JSONResponse({
                "world_size": len(self.pool.addresses), "version": self.executor.version,
                "deadlines": dataclasses.asdict(self.deadlines),
                "servers": [{"address": s.address, "healthy": s.healthy} for s in self.pool.snapshot()],
                "workers": 0 if self.workers is None else self.workers.num_workers,
            })

        @app.post(EPISODE_ROUTE)
        async def episode(request: Request) -> JSONResponse:
            data = await body_of(request)
            if self.workers is None:
                raise _BadRequest("this controller has no rollout workers")
            try:
                known = self.workers.report(data)
            except (KeyError, TypeError, ValueError) as exc:
                raise _BadRequest(f"bad episode report: {type(exc).__name__}: {exc}") from exc
            if not known:
                return JSONResponse({"success": False, "message": "no episode waits for this task"}, 404)
            return JSONResponse({"success": True})

        @app.post(READY_ROUTE)
        async def worker_ready(request: Request) -> JSONResponse:
            data = await body_of(request)
            if self.workers is not None:
                self.workers.mark_ready(int(data.get("worker", -1)))
            return JSONResponse({"success": True})

        @app.exception_handler(_BadRequest)
        async def bad_request(request: Request, exc: _BadRequest) -> JSONResponse:
            return JSONResponse({"success": False, "message": str(exc)}, 400)

        return _BearerAuth(app, self.secret)

    def _fleet_call(self, op: str, data: dict[str, Any]) -> Callable[[], Any]:
        """The fleet call a callback route makes, from its JSON body (raises on a malformed body)."""
        if op == "pause_generation":
            return self.pause_generation
        if op == "continue_generation":
            return self.continue_generation
        if op == "set_version":
            version = int(data["version"])
            return lambda: self.set_version(version)
        if op == "weight_checksums":
            names = data.get("names")
            return lambda: self.weight_checksums(None if names is None else [str(n) for n in names])
        meta = meta_from_json(data["meta"])
        commit = bool(data.get("commit", True))
        index = None if data.get("bucket_index") is None else int(data["bucket_index"])
        if op == "init_weights_update_group":
            return lambda: self.init_weights_update_group(meta)
        if op == "update_weights_from_distributed":
            specs = [spec_from_json(s) for s in data["specs"]]
            return lambda: self.update_weights_from_distributed(meta, specs, commit=commit, bucket_index=index)
        if op == "update_weights_from_shm":
            bucket = bucket_from_json(data["bucket"])
            return lambda: self.update_weights_from_shm(meta, bucket, commit=commit, bucket_index=index)
        if op == "destroy_weights_update_group":
            return lambda: self.destroy_weights_update_group(meta)
        if op == "update_weights_from_disk":
            return lambda: self.update_weights_from_disk(meta, commit=commit)
        if op == "commit_weights":
            return lambda: self.commit_weights(meta)
        if op == "discard_weights":
            return lambda: self.discard_weights(meta)
        raise ValueError(f"unknown fleet operation {op!r}")


class _BadRequest(Exception):
    pass


class _BearerAuth:
    """Every route needs `Authorization: Bearer <secret>` (constant-time comparison); 401 otherwise."""

    def __init__(self, app: ASGIApp, secret: str):
        self.app, self.expected = app, f"Bearer {secret}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                response = JSONResponse({"success": False, "message": "missing or wrong callback secret"}, 401)
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


class _EventServer(uvicorn.Server):
    """uvicorn whose main loop waits for `stop` instead of waking every 0.1 s to check a flag."""

    def __init__(self, config: uvicorn.Config):
        super().__init__(config)
        self.started_event = threading.Event()
        self._stop: asyncio.Event | None = None

    def capture_signals(self):  # a server in a thread leaves the process's signals alone
        return contextlib.nullcontext()

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        self._stop = asyncio.Event()
        await super().startup(sockets=sockets)
        self.started_event.set()

    async def main_loop(self) -> None:
        await self.on_tick(0)  # sets the default headers once
        assert self._stop is not None
        await self._stop.wait()

    def request_stop(self) -> None:
        self.should_exit = True
        if self._stop is not None:
            self._stop.set()


class _CallbackServer:
    """The callback app served by uvicorn on its own event loop, in a daemon thread."""

    def __init__(self, app: ASGIApp, host: str, port: int):
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.sock = socket.socket(family, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))
        self.sock.listen(256)
        bound_host, self.port = self.sock.getsockname()[:2]
        self.address = f"http://{f'[{bound_host}]' if ':' in bound_host else bound_host}:{self.port}"
        config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off",
                                timeout_graceful_shutdown=5, timeout_keep_alive=60)
        self.server = _EventServer(config)
        self.loop = asyncio.new_event_loop()
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


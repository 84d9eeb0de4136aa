"""`RolloutController`: the rollout side of the controller process.

It owns the servers as the rollout side sees them (the `ServerPool`, its `InferenceClient`, the
`WeightVersion`), the `WorkflowExecutor` (episodes, the one `StalenessManager`), optional rollout
worker processes, and the callback server (`callback_server.py`) through which trainer workers
(`RolloutCallback`) and rollout workers reach it with the run's secret.

It is a `Fleet` itself: `submit(op, request)` forwards any operation to an `HttpFleet` over the
pool's servers and takes a server that fails an operation marked `marks_unhealthy` out of routing.
Three operations get behaviour around them (protocol.md section 5 step 4): `pause_generation`
stops dispatching new episodes before the servers pause; `continue_generation` resumes dispatch
after they continue; a successful `set_version` moves the `WeightVersion` (capacity grows) before
the caller hears of it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import secrets
import threading
from collections.abc import Iterable
from concurrent.futures import Future
from typing import Any

from tandem.data.trajectory import Trajectory
from tandem.errors import ConfigError
from tandem.fleet import ops
from tandem.fleet.adapters import Capabilities, ServerAdapter
from tandem.fleet.http import HttpFleet
from tandem.fleet.ops import Deadlines, FleetOp
from tandem.fleet.results import FleetError, FleetResult
from tandem.rollout.callback import RolloutCallback
from tandem.rollout.callback_server import CallbackServer, build_app
from tandem.rollout.client import InferenceClient
from tandem.rollout.config import RolloutConfig
from tandem.rollout.executor import WorkflowExecutor
from tandem.rollout.pool import ServerPool
from tandem.rollout.version import WeightVersion
from tandem.rollout.workers import RemoteWorkflow, WorkerPool
from tandem.rollout.workflow import RolloutWorkflow

logger = logging.getLogger(__name__)


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
        self.version = WeightVersion()  # the one copy of the version on the rollout side
        self.client = InferenceClient(self.pool, config.client_config(), self.version)
        self.adapter: ServerAdapter = self.client.adapter
        self.executor = WorkflowExecutor(self.client, config.executor_config())
        self.deadlines = deadlines or Deadlines(http_s=config.control_timeout_s)
        self._fleet: HttpFleet | None = None
        self._old_fleets: list[HttpFleet] = []
        self.workers: WorkerPool | None = None
        self._remote: dict[int, tuple[RolloutWorkflow, RemoteWorkflow]] = {}
        self._lock = threading.Lock()
        self._driver_paused = False
        self._fleet_paused = False
        self._server: CallbackServer | None = None
        self._closed = False
        if start:
            self.start()

    # -- lifecycle ----------------------------------------------------------------------------------
    def start(self) -> RolloutController:
        if self._server is not None:
            return self
        self._server = CallbackServer(build_app(self), self.config.callback_host, self.config.callback_port)
        self._server.start()
        if self.config.workers > 0:
            self.workers = WorkerPool(self.config.workers, self.pool.addresses, self.config.client_config(),
                                      self.callback_address(), self.secret, self.version)
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
        """After a restart at `version` (whose weights the servers already hold): the trainer
        consumed `version` batches before it, which the staleness bound counts."""
        self.executor.staleness.on_version_recovered(version)
        self.version.set(version)

    def stats(self) -> dict[str, Any]:
        out = self.executor.stats()
        out["servers"] = [{"address": s.address, "healthy": s.healthy, "outstanding": s.outstanding}
                          for s in self.pool.snapshot()]
        return out

    def fleet_info(self) -> dict[str, Any]:
        """What `GET /fleet/info` answers: servers and health, world size, version, deadlines."""
        return {
            "world_size": len(self.pool.addresses), "version": self.version.value, "capabilities": dataclasses.asdict(self.capabilities),
            "deadlines": dataclasses.asdict(self.deadlines),
            "servers": [{"address": s.address, "healthy": s.healthy} for s in self.pool.snapshot()],
            "workers": 0 if self.workers is None else self.workers.num_workers,
        }

    # -- Fleet (a trainer in this process calls it; trainer workers reach it via RolloutCallback) --------
    @property
    def world_size(self) -> int:
        return len(self.pool.addresses)

    @property
    def capabilities(self) -> Capabilities:
        return self.adapter.capabilities

    def send(self, op: FleetOp, request: Any) -> Future[FleetResult]:
        """`op` on every server in the pool; see the module docstring for what happens around it."""
        if op is ops.PAUSE:
            self._set_fleet_paused(True)
        try:
            inner = self.fleet().send(op, request)
        except BaseException:
            self._after(op, request, failed=True)
            raise
        outer: Future[FleetResult] = Future()

        def settle(fut: Future[FleetResult]) -> None:
            exc = fut.exception()
            if isinstance(exc, FleetError):
                self._on_failure(op, exc)
            try:
                self._after(op, request, failed=exc is not None)
            except BaseException as hook_error:
                exc = exc or hook_error
            if exc is None:
                outer.set_result(fut.result())
            else:
                outer.set_exception(exc)

        inner.add_done_callback(settle)
        return outer

    def fleet(self) -> HttpFleet:
        """The `HttpFleet` over the pool's current servers (rebuilt when the membership changed)."""
        addresses = self.pool.addresses
        with self._lock:
            if self._fleet is None or self._fleet.addresses != addresses:
                if self._fleet is not None:
                    self._old_fleets.append(self._fleet)  # calls may be in flight on it: closed at shutdown
                self._fleet = HttpFleet(addresses, adapter=self.adapter, api_key=self.config.api_key,
                                        deadlines=self.deadlines)
            return self._fleet

    def _after(self, op: FleetOp, request: Any, failed: bool) -> None:
        if op is ops.CONTINUE:  # the servers go on (or were asked to): so does dispatch
            self._set_fleet_paused(False)
        elif op is ops.SET_VERSION and not failed:
            self.version.set(request.version)
        elif op is ops.PAUSE and failed:
            self._set_fleet_paused(False)

    def _on_failure(self, op: FleetOp, exc: FleetError) -> None:
        for failure in exc.failures:
            logger.error("fleet %s failed on %s: %s", op.name, failure.address, failure.message)
            if op.marks_unhealthy:
                self.pool.mark_unhealthy(failure.address)

    def _set_fleet_paused(self, paused: bool) -> None:
        with self._lock:
            self._fleet_paused = paused
            self._sync_dispatch()

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

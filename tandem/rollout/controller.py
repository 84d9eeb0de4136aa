"""`RolloutController`: the rollout side of the controller process.

It owns the fleet as the rollout side sees it (the `ServerPool` and its `InferenceClient`), the
`WorkflowExecutor` (episodes, the one `StalenessManager`), optional rollout worker processes, and a
small HTTP callback server on 127.0.0.1 (`callback_server.py`: routes, auth, uvicorn in a thread)
through which trainer workers (`RolloutCallback`) and rollout workers reach it with the run's secret.

The controller is also a `Fleet` itself (same methods), for a trainer that lives in the controller
process; the callback server calls these same methods. Around a weight update the fleet operations
keep protocol.md section 5 step 4 in order: `pause_generation` stops the dispatch of new episodes
and then pauses the servers (in-flight requests come back with their partial output and wait);
`set_version(v)` tells the servers and then the executor (capacity grows); `continue_generation`
releases the servers and then resumes dispatch.

The fan-out itself is `tandem.weights.http_fleet.HttpFleet` over the pool's servers (one
implementation for direct and controller-mediated fleets, flat buckets included). Nothing polls:
fleet calls are awaited HTTP requests, and waiting callers block on futures and conditions.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import secrets
import threading
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future
from typing import Any

from tandem.data.trajectory import Trajectory
from tandem.errors import ConfigError
from tandem.rollout.callback import RolloutCallback
from tandem.rollout.callback_server import CallbackServer, build_app
from tandem.rollout.client import InferenceClient
from tandem.rollout.config import RolloutConfig
from tandem.rollout.executor import WorkflowExecutor
from tandem.rollout.pool import ServerPool
from tandem.rollout.workers import RemoteWorkflow, WorkerPool
from tandem.rollout.workflow import RolloutWorkflow
from tandem.weights.fleet import FleetError, FleetResult, ServerChecksums
from tandem.weights.http_fleet import HttpFleet
from tandem.weights.meta import Deadlines, FlatLayout, ParamSpec, ShmBucket, WeightUpdateMeta

logger = logging.getLogger(__name__)

# Phases after which a failing server is taken out of routing: it may be paused, or serve old weights.
_UNHEALTHY_ON_FAILURE = {"pause_generation", "continue_generation", "update_weights_from_disk",
                         "update_weights_from_distributed", "update_weights_from_shm", "commit_weights", "set_version"}


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

    def fleet_info(self) -> dict[str, Any]:
        """What `GET /fleet/info` answers: servers and health, world size, version, deadlines."""
        return {
            "world_size": len(self.pool.addresses), "version": self.executor.version,
            "deadlines": dataclasses.asdict(self.deadlines),
            "servers": [{"address": s.address, "healthy": s.healthy} for s in self.pool.snapshot()],
            "workers": 0 if self.workers is None else self.workers.num_workers,
        }

    # -- Fleet (a trainer in this process calls these; trainer workers reach them via RolloutCallback) --
    supports_flat_buckets = HttpFleet.supports_flat_buckets  # every call is forwarded to an HttpFleet

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
                                        commit: bool = True, bucket_index: int | None = None,
                                        flat: FlatLayout | None = None) -> Future[FleetResult]:
        return self._checked("update_weights_from_distributed", lambda f: f.update_weights_from_distributed(
            meta, specs, commit=commit, bucket_index=bucket_index, flat=flat))

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

"""`RolloutController`: the rollout side of the controller process.

It owns the `ElasticFleet` (membership, health monitor, routing), the `ServerPool`, its
`InferenceClient`, the `WeightVersion`, the `WorkflowExecutor` (the one `StalenessManager`),
optional rollout worker processes and the callback server. It is a `Fleet`: `send` forwards any
operation to the elastic fleet, and `pause_generation` stops dispatch before the servers pause,
`continue_generation` resumes it after they continue, and a successful `set_version` moves the
`WeightVersion` before the caller hears of it. Episodes start only while `rollout.min_servers`
are healthy; after `min_servers_grace_s` below that, rollouts fail with `FleetTooSmall`. See
docs/rollout.md, "Controller and callbacks"."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import resource
import secrets
import threading
from collections.abc import Iterable, Sequence
from concurrent.futures import Future
from typing import Any

from tandem.data.trajectory import Trajectory
from tandem.errors import ConfigError
from tandem.fleet import ops
from tandem.fleet.adapters import Capabilities, ServerAdapter
from tandem.fleet.interface import Topology
from tandem.fleet.ops import Deadlines, FleetOp, announces_version
from tandem.fleet.results import FleetResult
from tandem.fleet.routed_experts import RoutedExpertLayout
from tandem.rollout.callback import RolloutCallback
from tandem.rollout.callback_server import CallbackServer, build_app
from tandem.rollout.client import InferenceClient
from tandem.rollout.config import RolloutConfig
from tandem.rollout.elastic import ElasticFleet
from tandem.rollout.executor import WorkflowExecutor
from tandem.rollout.frontier import FrontierState
from tandem.rollout.pool import ServerPool
from tandem.rollout.scoring import ScoringFleet
from tandem.rollout.version import WeightVersion
from tandem.rollout.workers import RemoteWorkflow, WorkerPool
from tandem.rollout.workflows.base import RolloutWorkflow

logger = logging.getLogger(__name__)


class RolloutController:
    def __init__(self, config: RolloutConfig, secret: str | None = None, deadlines: Deadlines | None = None,
                 start: bool = True, routed_expert_layout: RoutedExpertLayout | None = None,
                 scorers: Sequence[ScoringFleet] = ()):
        """`routed_expert_layout` (a MoE model's, `RoutedExpertLayout.of_model`): rollouts ask the servers for the
        routed experts and trajectories carry them (`Trajectory.routed_experts`; routing replay r3).
        `scorers` (a teacher, a reward model: `tandem.rollout.scoring`): every episode is scored by
        each before it is accepted; the controller starts and closes them with its own fleet."""
        config.check()
        if not config.servers:
            raise ConfigError("the rollout controller needs server addresses (rollout.servers); for a tandem "
                              "backend the launcher fills them in after starting the servers")
        self.config = config
        client_config = config.client_config(routed_expert_layout)
        _allow_open_files(len(config.servers), client_config.max_connections)
        self.secret = secret or secrets.token_urlsafe(32)
        self.join_token = secrets.token_urlsafe(32)  # for `tandem serve --join` and `tandem fleet` only
        self.pool = ServerPool(config.servers)
        self.version = WeightVersion()  # the one copy of the version on the rollout side
        self.client = InferenceClient(self.pool, client_config, self.version)
        self.adapter: ServerAdapter = self.client.adapter
        self.scorers = list(scorers)
        self.executor = WorkflowExecutor(self.client, config.executor_config(), scorers=self.scorers)
        self.deadlines = deadlines or Deadlines(http_s=config.control_timeout_s)
        self.fleet = ElasticFleet(
            config.servers, self.pool, self.adapter, health=config.health, min_servers=config.min_servers,
            min_servers_grace_s=config.min_servers_grace_s, topology_cooldown_s=config.topology_cooldown_s,
            deadlines=self.deadlines, api_key=config.api_key, devices=config.devices_per_server)
        self.workers: WorkerPool | None = None
        self._remote: dict[int, tuple[RolloutWorkflow, RemoteWorkflow]] = {}
        self._lock = threading.Lock()
        self._driver_paused = False
        self._fleet_paused = False
        self._fleet_ready = True
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
        self.fleet.watch_ready(self._set_fleet_ready)
        self.fleet.start(on_too_small=self.executor.fail)
        for scorer in self.scorers:
            scorer.start(on_too_small=self.executor.fail)
        if self.config.workers > 0:
            self.workers = WorkerPool(self.config.workers, self.pool.addresses, self.client.config,
                                      self.callback_address(), self.secret, self.version)
            self.workers.start()
            try:
                self.workers.wait_ready(self.config.worker_start_timeout_s)
            except BaseException:
                self.shutdown()
                raise
            self.fleet.membership.watch(self.workers.set_servers)
            self.fleet.membership.watch_evictions(self.workers.abandon)
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
            with contextlib.suppress(Exception):
                self.fleet.close()
            for scorer in self.scorers:
                with contextlib.suppress(Exception):
                    scorer.close()

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

    def recover_version(self, version: int, frontier: FrontierState | None = None) -> None:
        """After a restart at `version` (whose weights the servers already hold): the trainer
        consumed `version` batches before it, which the staleness bound counts; `frontier`: the
        item stream's, saved with the checkpoint (items beyond it are drawn again)."""
        self.executor.staleness.on_version_recovered(version)
        if frontier is not None:
            self.executor.restore_frontier(frontier)
        self.version.set(version)

    def frontier(self) -> FrontierState:
        """The item stream's frontier (`tandem.rollout.frontier`), for a checkpoint."""
        return self.executor.frontier()

    def stats(self) -> dict[str, Any]:
        out = self.executor.stats()
        out["servers"] = [{"address": s.address, "healthy": s.healthy, "outstanding": s.outstanding}
                          for s in self.pool.snapshot() if s.routable]
        return out

    def step_metrics(self) -> dict[str, float]:
        """The fleet's numbers for the step's metrics row: healthy servers, evictions and joins so
        far, generation calls resubmitted after a server failed, episodes lost (failed); and each
        scoring fleet's (`ScoringFleet.stats`)."""
        counts = self.executor.stats()
        resubmitted = self.client.resubmitted_total + (self.workers.resubmitted_total if self.workers else 0)
        out = {**self.fleet.stats(), "rollout/resubmitted_total": float(resubmitted),
               "rollout/lost_total": float(counts["failed"])}
        for scorer in self.scorers:
            out.update(scorer.stats())
        return out

    def fleet_info(self) -> dict[str, Any]:
        """What `GET /fleet/info` answers: servers and health, world size, version, deadlines."""
        return {
            "world_size": self.world_size, "version": self.version.value,
            "capabilities": dataclasses.asdict(self.capabilities), "deadlines": dataclasses.asdict(self.deadlines),
            "servers": [{"address": r["address"], "state": r["state"]} for r in self.members()["servers"]],
            "workers": 0 if self.workers is None else self.workers.num_workers,
        }

    def members(self) -> dict[str, Any]:
        """What `GET /fleet/members` answers (`tandem fleet`)."""
        return self.fleet.members()

    def join(self, address: str, pid: int | None, listed: bool = False, devices: int = 1) -> str:
        """A server asked to join (`tandem serve --join`; `listed`: a replacement the run launched,
        probed while evicted like the servers it started with; `devices`: its ranks in a transfer
        group); -> its state."""
        return self.fleet.join(address, pid, listed=listed, devices=devices)

    # -- Fleet (a trainer in this process calls it; trainer workers reach it via RolloutCallback) --------
    @property
    def world_size(self) -> int:
        return self.fleet.world_size

    @property
    def capabilities(self) -> Capabilities:
        return self.adapter.capabilities

    def topology(self) -> Topology:
        return self.fleet.topology()

    def admit(self, addresses: Sequence[str], version: int) -> None:
        self.fleet.admit(addresses, version)

    def send(self, op: FleetOp, request: Any, targets: Sequence[str] | None = None) -> Future[FleetResult]:
        """`op` on `targets` (default: the members); see the module docstring for what happens
        around it."""
        if op is ops.PAUSE:
            self._set_fleet_paused(True)
        try:
            inner = self.fleet.send(op, request, targets)
        except BaseException:
            self._after(op, request, failed=True)
            raise
        outer: Future[FleetResult] = Future()

        def settle(fut: Future[FleetResult]) -> None:
            exc = fut.exception()
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

    def _after(self, op: FleetOp, request: Any, failed: bool) -> None:
        if op is ops.CONTINUE:  # the servers go on (or were asked to): so does dispatch
            self._set_fleet_paused(False)
        elif announces_version(op, request) and not failed:
            self.version.set(request.version)
        elif op is ops.PAUSE and failed:
            self._set_fleet_paused(False)

    def _set_fleet_paused(self, paused: bool) -> None:
        with self._lock:
            self._fleet_paused = paused
            self._sync_dispatch()

    def _set_fleet_ready(self, ready: bool) -> None:
        with self._lock:
            self._fleet_ready = ready
            self._sync_dispatch()

    # -- internals ----------------------------------------------------------------------------------
    def _sync_dispatch(self) -> None:  # under self._lock
        if self._driver_paused or self._fleet_paused or not self._fleet_ready:
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


def _allow_open_files(servers: int, client_connections: int) -> None:
    """Raise this process's soft open-file limit toward the hard one when the fleet needs more than
    it allows: a connection per server for probes and one for fleet operations, the client's
    connections, and room for the rest. A soft limit of 1,024 (a common default) is spent by 500
    servers, and the calls past it fail as if the servers were unreachable."""
    needed = 2 * servers + min(client_connections, 4 * servers) + 256
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= needed:
        return
    target = needed if hard == resource.RLIM_INFINITY else min(hard, needed)
    resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    if target < needed:
        logger.warning("%d servers need about %d open files; the hard limit is %d (raise it: ulimit -Hn, or "
                       "LimitNOFILE in a systemd unit)", servers, needed, hard)

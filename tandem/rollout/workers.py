"""Rollout worker processes: run workflows away from the controller, report each episode over HTTP.

With `rollout.workers = K` the controller spawns K processes, each with its own event loop and
`InferenceClient`. The controller's executor still decides when an episode starts; a
`RemoteWorkflow` sends the item down a pipe to the least busy worker, which POSTs the outcome to
`/rollout/episode`. A worker that dies fails its episodes at once. Workflows must be picklable
(sent once per worker). Start the pool from a long-lived thread (`die_with_creator`). See
docs/rollout.md, "Controller and callbacks"."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import multiprocessing
import multiprocessing.connection
import os
import pickle
import threading
import time
import traceback
import uuid
from concurrent.futures import Future
from dataclasses import asdict, dataclass, field
from typing import Any

from tandem import aio
from tandem.data.trajectory import Trajectory
from tandem.launch.guard import die_with_creator
from tandem.rollout.client import ClientConfig, InferenceClient
from tandem.rollout.errors import RolloutError
from tandem.rollout.version import WeightVersion
from tandem.rollout.workflows.base import EpisodeResult, RolloutWorkflow, as_trajectories

logger = logging.getLogger(__name__)

EPISODE_ROUTE = "/rollout/episode"
READY_ROUTE = "/rollout/worker_ready"


class RemoteWorkflow(RolloutWorkflow):
    """Stands in for `workflow` on the controller's executor: the episode runs in a worker."""

    def __init__(self, pool: WorkerPool, workflow: RolloutWorkflow):
        self.pool = pool
        self.workflow = workflow
        self.key = uuid.uuid4().hex
        self._pickled: bytes | None = None

    def pickled(self) -> bytes:
        if self._pickled is None:
            try:
                self._pickled = pickle.dumps(self.workflow)
            except Exception as exc:
                raise TypeError(
                    f"{type(self.workflow).__name__} cannot be sent to rollout worker processes "
                    f"(it must be picklable): {exc}"
                ) from exc
        return self._pickled

    async def arun_episode(self, client: InferenceClient, item: Any) -> EpisodeResult:
        return await self.pool.run(self, item)


@dataclass
class _Worker:
    index: int
    process: Any
    conn: Any  # the controller's end of the command pipe
    outstanding: int = 0
    resubmitted: int = 0  # its client's resubmissions so far (each episode report carries the count)
    alive: bool = True
    workflows: set[str] = field(default_factory=set)
    send_lock: threading.Lock = field(default_factory=threading.Lock)
    ready: threading.Event = field(default_factory=threading.Event)

    def send(self, msg: tuple) -> None:
        with self.send_lock:
            self.conn.send(msg)


class WorkerPool:
    def __init__(self, num_workers: int, addresses: list[str], client_config: ClientConfig,
                 callback_address: str, secret: str, version: WeightVersion):
        self.num_workers = num_workers
        self._args = (addresses, asdict(client_config), callback_address, secret)
        self._lock = threading.Lock()
        self._workers: list[_Worker] = []
        self._tasks: dict[str, tuple[_Worker, Future]] = {}
        self._ids = itertools.count()
        self._closed = False
        version.watch(self._send_version)  # each worker's client mirrors the controller's version
        self._wake_r, self._wake_w = multiprocessing.Pipe(duplex=False)
        self._monitor: threading.Thread | None = None

    # -- lifecycle ----------------------------------------------------------------------------------
    def start(self) -> None:
        ctx = multiprocessing.get_context("spawn")
        for i in range(self.num_workers):
            ours, theirs = ctx.Pipe(duplex=False)  # (reader, writer): the worker reads
            proc = ctx.Process(target=worker_main, args=(i, ours, os.getpid(), *self._args),
                               name=f"tandem-rollout-worker-{i}")
            proc.start()
            ours.close()
            self._workers.append(_Worker(i, proc, theirs))
        self._monitor = threading.Thread(target=self._watch, name="tandem-rollout-workers", daemon=True)
        self._monitor.start()

    def wait_ready(self, timeout: float) -> None:
        """Block until every worker reported in (or raise, naming the ones that did not)."""
        deadline = time.monotonic() + timeout
        for w in self._workers:
            if not w.ready.wait(max(0.0, deadline - time.monotonic())):
                state = "exited" if not w.process.is_alive() else "did not report"
                raise RolloutError(f"rollout worker {w.index} (pid {w.process.pid}) {state} within {timeout:g}s")

    def abandon(self, address: str) -> None:
        """Each worker's client gives up its calls in flight to `address` (evicted)."""
        for w in self._alive():
            with contextlib.suppress(OSError, ValueError):
                w.send(("abandon", address))

    @property
    def pids(self) -> list[int]:
        return [w.process.pid for w in self._workers]

    def _send_version(self, version: int) -> None:
        for w in self._alive():
            with contextlib.suppress(OSError, ValueError):
                w.send(("version", version))

    def set_servers(self, addresses: list[str]) -> None:
        """Each worker's client routes to exactly `addresses` from now on (the membership's
        healthy set)."""
        self._args = (list(addresses), *self._args[1:])
        for w in self._alive():
            with contextlib.suppress(OSError, ValueError):
                w.send(("servers", list(addresses)))

    @property
    def resubmitted_total(self) -> int:
        with self._lock:
            return sum(w.resubmitted for w in self._workers)

    def shutdown(self, timeout: float = 10.0) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            pending = list(self._tasks.values())
        for w in self._workers:
            with contextlib.suppress(OSError, ValueError):
                w.send(("stop",))
        deadline = time.monotonic() + timeout
        for w in self._workers:
            w.process.join(max(0.0, deadline - time.monotonic()))
            if w.process.is_alive():
                logger.warning("rollout worker %d did not stop in %.0fs; killing it", w.index, timeout)
                w.process.kill()
                w.process.join(5)
            w.conn.close()
        with contextlib.suppress(OSError):
            self._wake_w.send(None)
        if self._monitor is not None:
            self._monitor.join(5)
        for _, fut in pending:
            if not fut.done():
                fut.cancel()

    # -- episodes (executor loop) -------------------------------------------------------------------
    async def run(self, remote: RemoteWorkflow, item: Any) -> EpisodeResult:
        payload = remote.pickled()
        fut: Future = Future()
        with self._lock:
            if self._closed:
                raise RolloutError("the rollout worker pool is shut down")
            alive = [w for w in self._workers if w.alive]
            if not alive:
                raise RolloutError("no rollout worker process is alive")
            worker = min(alive, key=lambda w: (w.outstanding, w.index))
            task_id = f"{next(self._ids)}"
            self._tasks[task_id] = (worker, fut)
            worker.outstanding += 1
        try:
            if remote.key not in worker.workflows:
                worker.send(("workflow", remote.key, payload))
                worker.workflows.add(remote.key)
            worker.send(("run", task_id, remote.key, item))
            return await asyncio.wrap_future(fut)
        except asyncio.CancelledError:
            with contextlib.suppress(OSError, ValueError):
                worker.send(("cancel", task_id))
            raise
        finally:
            with self._lock:
                self._tasks.pop(task_id, None)
                worker.outstanding -= 1

    # -- reports (callback server's loop) -------------------------------------------------------------
    def report(self, data: dict[str, Any]) -> bool:
        """A worker's report of one episode; False when no episode waits for it (e.g. cancelled)."""
        with self._lock:
            entry = self._tasks.get(str(data.get("task_id")))
        if entry is None:
            return False
        worker, fut = entry
        with self._lock:
            worker.resubmitted = max(worker.resubmitted, int(data.get("resubmitted", 0)))
        if fut.done():
            return False
        status = data.get("status")
        if status == "accepted":
            fut.set_result([Trajectory.from_dict(t) for t in data["trajectories"]])
        elif status == "rejected":
            fut.set_result(None)
        else:
            fut.set_exception(RolloutError(f"rollout worker {worker.index}: {data.get('error', 'unknown error')}"))
        return True

    def mark_ready(self, index: int) -> None:
        if 0 <= index < len(self._workers):
            self._workers[index].ready.set()

    # -- internals ----------------------------------------------------------------------------------
    def _alive(self) -> list[_Worker]:
        with self._lock:
            return [w for w in self._workers if w.alive]

    def _watch(self) -> None:
        """Block on the workers' sentinels; a worker that exits fails its episodes at once."""
        while True:
            alive = self._alive()
            sentinels = {w.process.sentinel: w for w in alive}
            ready = multiprocessing.connection.wait([*sentinels, self._wake_r])
            if self._wake_r in ready:
                return
            for s in ready:
                w = sentinels[s]
                w.process.join()
                with self._lock:
                    w.alive = False
                    lost = [f for (ww, f) in self._tasks.values() if ww is w]
                    closed = self._closed
                if not closed:
                    logger.error("rollout worker %d (pid %d) exited with code %s; %d episode(s) fail",
                                 w.index, w.process.pid, w.process.exitcode, len(lost))
                for f in lost:
                    if not f.done():
                        f.set_exception(RolloutError(f"rollout worker {w.index} exited (code {w.process.exitcode})"))
            if not self._alive():
                return


# -- the worker process -----------------------------------------------------------------------------


def worker_main(index: int, conn: Any, creator_pid: int, addresses: list[str], client_config: dict[str, Any],
                callback_address: str, secret: str) -> None:
    die_with_creator(creator_pid)  # SIGKILLed with the controller: nothing of the run outlives it
    logging.basicConfig(level=logging.WARNING, format=f"%(asctime)s rollout-worker-{index} %(name)s %(levelname)s %(message)s")
    aio.run(_WorkerProcess(index, conn, addresses, client_config, callback_address, secret).main())


class _WorkerProcess:
    def __init__(self, index: int, conn: Any, addresses: list[str], client_config: dict[str, Any],
                 callback_address: str, secret: str):
        self.index = index
        self.conn = conn
        self.client = InferenceClient(addresses, ClientConfig(**client_config))
        self.callback_address = callback_address.rstrip("/")
        self.headers = {"Authorization": f"Bearer {secret}"}
        self.workflows: dict[str, RolloutWorkflow] = {}
        self.tasks: dict[str, asyncio.Task] = {}

    async def main(self) -> None:
        import aiohttp

        self.loop = asyncio.get_running_loop()
        self.stop = asyncio.Event()
        self.session = aiohttp.ClientSession(headers=self.headers)
        reader = threading.Thread(target=self._read, name="commands", daemon=True)
        reader.start()
        try:
            await self._post(READY_ROUTE, {"worker": self.index, "pid": os.getpid()})
            await self.stop.wait()
        finally:
            for t in list(self.tasks.values()):
                t.cancel()
            await asyncio.gather(*self.tasks.values(), return_exceptions=True)
            for wf in self.workflows.values():
                with contextlib.suppress(Exception):
                    await asyncio.to_thread(wf.close)
            await self.client.aclose()
            await self.session.close()

    def _read(self) -> None:
        """Blocks on the command pipe; hands each message to the loop. EOF: the controller is gone."""
        while True:
            try:
                msg = self.conn.recv()
            except (EOFError, OSError):
                msg = ("stop",)
            self.loop.call_soon_threadsafe(self._handle, msg)
            if msg[0] == "stop":
                return

    def _handle(self, msg: tuple) -> None:
        kind = msg[0]
        if kind == "run":
            _, task_id, key, item = msg
            task = self.loop.create_task(self._episode(task_id, key, item))
            self.tasks[task_id] = task
            task.add_done_callback(lambda _t, tid=task_id: self.tasks.pop(tid, None))
        elif kind == "workflow":
            _, key, payload = msg
            self.workflows[key] = pickle.loads(payload)
        elif kind == "cancel":
            if (task := self.tasks.get(msg[1])) is not None:
                task.cancel()
        elif kind == "version":
            self.client.version.set(msg[1])
        elif kind == "servers":
            self.client.pool.set_routable(msg[1])
        elif kind == "abandon":
            self.client.pool.abandon(msg[1])
        elif kind == "stop":
            self.stop.set()

    async def _episode(self, task_id: str, key: str, item: Any) -> None:
        try:
            result = as_trajectories(await self.workflows[key].arun_episode(self.client, item))
            if result is None:
                report: dict[str, Any] = {"task_id": task_id, "status": "rejected"}
            else:
                report = {"task_id": task_id, "status": "accepted", "trajectories": [t.to_dict() for t in result]}
        except asyncio.CancelledError:
            return  # the controller cancelled it (shutdown): nobody waits for a report
        except Exception:
            report = {"task_id": task_id, "status": "failed", "error": traceback.format_exc(limit=20)}
        report["resubmitted"] = self.client.resubmitted_total
        await self._post(EPISODE_ROUTE, report)

    async def _post(self, route: str, body: dict[str, Any]) -> None:
        import aiohttp

        for attempt in range(5):  # the controller is local: a failure here is rare and brief
            try:
                async with self.session.post(self.callback_address + route, json=body,
                                             timeout=aiohttp.ClientTimeout(total=30)) as resp:
                    if resp.status < 500:
                        if resp.status >= 400 and resp.status != 404:
                            logger.error("controller refused %s: %d %s", route, resp.status, await resp.text())
                        return
            except (aiohttp.ClientError, TimeoutError) as exc:
                logger.warning("reporting to the controller failed (%s); retrying", exc)
            await asyncio.sleep(0.2 * 2**attempt)
        logger.error("could not report to the controller at %s%s", self.callback_address, route)

"""`RayScheduler`: every server and trainer rank runs under a `ProcessHost` Ray actor, one placement
group (one bundle per process) per `start_*` call.

The process runs on the actor's node under `tandem.launch.guard` and logs to
`<run_dir>/logs/<name>.log` (the run directory must be on storage every node sees). The controller
sees it as a `RayProcess`, whose sentinel fires when the actor's `wait()` returns or fails, so an
actor's or node's death ends calls at once. `scheduler.ray.address`: None starts a private Ray,
'auto' or HOST:PORT joins a cluster. See docs/launch.md, "Ray"."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from tandem.launch.config import RaySchedulerConfig
from tandem.launch.process import (
    LaunchedProcess,
    describe_process,
    describe_returncode,
    process_group_alive,
    read_log_tail,
)
from tandem.launch.process_scheduler import ProcessScheduler
from tandem.launch.scheduler import LaunchError, RunProcesses
from tandem.net import is_loopback

logger = logging.getLogger("tandem.launch")
PLACEMENT_TIMEOUT_S = 300.0
_CALL_TIMEOUT_S = 60.0


class ProcessHost:
    """A Ray actor that runs one process on its node and reports its end (`wait`)."""

    def __init__(self) -> None:
        self.popen: subprocess.Popen | None = None

    def start(self, cmd: list[str], env: dict[str, str], log_path: str) -> dict[str, Any]:
        full_env = {**os.environ, **env}
        guarded = [sys.executable, "-m", "tandem.launch.guard", str(os.getpid()), "--", *cmd]
        Path(log_path).parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "ab") as log:
            self.popen = subprocess.Popen(guarded, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                          env=full_env, start_new_session=True)
        return {"pid": self.popen.pid, "hostname": socket.gethostname(), "node_ip": ray.util.get_node_ip_address()}

    def wait(self) -> int:
        assert self.popen is not None
        return self.popen.wait()

    def signal(self, sig: int) -> None:
        if self.popen is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.popen.pid, sig)

    def group_alive(self) -> bool:
        return self.popen is not None and process_group_alive(self.popen.pid)


_RemoteHost = ray.remote(ProcessHost)


class RayProcess:
    """The controller's view of one process under a `ProcessHost` actor."""

    def __init__(self, name: str, actor: Any, log_path: Path, log_start: int, info: dict[str, Any]):
        self.name, self.actor, self.log_path, self.log_start = name, actor, log_path, log_start
        self.pid: int | None = info["pid"]
        self.started = time.monotonic()
        self._placement = f"Ray node {info['node_ip']} ({info['hostname']}), pid {info['pid']}"
        self._returncode: int | None = None
        self._death: str | None = None  # the actor (or its node) died
        self._ended = threading.Event()
        self._read, self._write = os.pipe()
        threading.Thread(target=self._watch, name=f"tandem-ray-{name}", daemon=True).start()

    def _watch(self) -> None:
        try:
            self._returncode = ray.get(self.actor.wait.remote())
        except Exception as exc:  # RayActorError and friends: the actor, its worker or its node is gone
            self._death = f"its Ray actor died ({type(exc).__name__}: {str(exc).splitlines()[0][:200]})"
        self._ended.set()
        with contextlib.suppress(OSError):
            os.write(self._write, b"x")

    @property
    def sentinel(self) -> int:
        return self._read

    @property
    def placement(self) -> str:
        return self._placement

    def placed(self, hostname: str, address: str, pid: int, where: str) -> None:
        self._placement = f"Ray node {address} ({hostname}), pid {pid}" + (f", {where}" if where else "")

    def poll(self) -> int | None:
        if not self._ended.is_set():
            return None
        return self._returncode if self._death is None else -signal.SIGKILL

    def exit_status(self, wait_s: float = 0.0) -> str:
        self._ended.wait(wait_s)
        if not self._ended.is_set():
            return "still running"
        return self._death or describe_returncode(self._returncode)

    def log_tail(self, lines: int = 40) -> str:
        return read_log_tail(self.log_path, self.log_start, lines)

    def describe(self, what: str, lines: int = 40) -> str:
        return describe_process(self, what, lines)

    def waiting_reason(self) -> str:
        return ""

    def signal_group(self, sig: int) -> None:
        if not self._ended.is_set():
            with contextlib.suppress(Exception):
                self.actor.signal.remote(sig)

    def group_alive(self) -> bool:
        try:
            return bool(ray.get(self.actor.group_alive.remote(), timeout=5.0))
        except Exception:
            return False

    def reap(self, timeout_s: float) -> None:
        self._ended.wait(timeout_s)

    def release(self) -> None:
        with contextlib.suppress(Exception):
            ray.kill(self.actor)
        for fd in (self._read, self._write):
            with contextlib.suppress(OSError):
                os.close(fd)
        self._read = -1


class RayScheduler(ProcessScheduler):
    """Processes under Ray actors (see the module docstring); `config` is `scheduler.ray`, `host`
    the controller's address as the nodes reach it (`cluster.host_ip`), `processes` what the run
    will start (a private cluster is sized to hold it: `RaySchedulerConfig.private_cpus`; a cluster
    it joins is left as it is)."""

    def __init__(self, run_dir: str | Path | None, config: RaySchedulerConfig, *, host: str = "127.0.0.1",
                 processes: RunProcesses | None = None, **kwargs: object):
        super().__init__(run_dir, host=host, **kwargs)  # type: ignore[arg-type]
        self.config = config
        self.placement_groups: list[PlacementGroup] = []
        self._started_ray = False
        if not ray.is_initialized():
            began = time.monotonic()
            if config.address is None:
                options: dict[str, Any] = {"num_cpus": self._private_cpus(processes)}
                if is_loopback(host):
                    options["_node_ip_address"] = host
                ray.init(namespace=config.namespace, include_dashboard=False, log_to_driver=False, **options)
            else:
                ray.init(address=config.address, namespace=config.namespace, log_to_driver=False)
            self._started_ray = True
            logger.info("ray: %s in %.1f s (%s)", "started a private cluster" if config.address is None else
                        f"joined {config.address}", time.monotonic() - began, ray.cluster_resources())

    def _private_cpus(self, processes: RunProcesses | None) -> int:
        """`config.private_cpus` on this machine, saying when it differs from the machine's count."""
        machine = os.cpu_count() or 1
        cpus = self.config.private_cpus(processes, machine)
        need = self.config.cpus_needed(processes)
        if processes is None:
            return cpus
        what = (f"{processes.describe()} x scheduler.ray.cpus_per_process={self.config.cpus_per_process:g} "
                f"reserve {need} CPU(s)")
        if self.config.num_cpus and cpus < need:
            logger.warning("ray: the private cluster has scheduler.ray.num_cpus=%d CPU(s), but the run's %s: a "
                           "placement it can never hold is refused, one that waits for CPUs the run's other "
                           "processes hold fails after %.0f s; raise scheduler.ray.num_cpus (or set it to 0: "
                           "sized to the run) or lower scheduler.ray.cpus_per_process", cpus, what,
                           PLACEMENT_TIMEOUT_S)
        elif cpus > machine:
            logger.info("ray: the private cluster gets %d logical CPU(s), more than this machine's %d: the run's %s, "
                        "and they share the machine's cores as the local scheduler's processes do "
                        "(scheduler.ray.num_cpus sets the count)", cpus, machine, what)
        return cpus

    def _bundles(self, count: int, gpus: int) -> list[dict[str, float]]:
        bundle: dict[str, float] = {"CPU": self.config.cpus_per_process}
        if gpus:
            bundle["GPU"] = float(gpus)
        return [dict(bundle) for _ in range(count)]

    def _refuse_impossible(self, name: str, bundles: list[dict[str, float]]) -> None:
        """Raise at once if the cluster could never place `bundles` (its TOTAL resources, not the free
        ones: the placement would wait out PLACEMENT_TIMEOUT_S for nothing)."""
        strategy = self.config.strategy
        nodes = [node["Resources"] for node in ray.nodes() if node.get("Alive")]
        totals: dict[str, float] = {}
        for node in nodes:
            for key, value in node.items():
                totals[key] = totals.get(key, 0.0) + value
        need: dict[str, float] = {}
        for bundle in bundles:
            for key, value in bundle.items():
                need[key] = need.get(key, 0.0) + value

        def fits(node: dict[str, float], want: dict[str, float]) -> bool:
            return all(node.get(key, 0.0) + 1e-9 >= value for key, value in want.items())

        hosts = sum(fits(node, bundles[0]) for node in nodes)  # nodes that could hold one bundle
        if strategy == "STRICT_PACK":
            possible = any(fits(node, need) for node in nodes)
            why = f"one node must hold {need}"
        elif strategy == "STRICT_SPREAD":
            possible = hosts >= len(bundles)
            why = f"{len(bundles)} nodes must each hold one; {hosts} can"
        else:
            possible = hosts > 0 and fits(totals, need)
            why = f"they need {need} in all"
        if not possible:
            have = {key: totals.get(key, 0.0) for key in need}
            raise LaunchError(
                f"{name}: Ray can never place {len(bundles)} bundle(s) of {bundles[0]} ({strategy}): {why}, and the "
                f"cluster has {len(nodes)} node(s) with {have} in all. Lower scheduler.ray.cpus_per_process or "
                f"the processes of the allocation, or give the cluster more (scheduler.ray.num_cpus for the private "
                f"cluster Tandem starts, more nodes for a cluster it joins)")

    def _group(self, name: str, bundles: list[dict[str, float]]) -> PlacementGroup:
        self._refuse_impossible(name, bundles)
        pg = placement_group(bundles, strategy=self.config.strategy, name=f"{name}-{os.getpid()}-{len(self.placement_groups)}")
        self.placement_groups.append(pg)
        ready, _ = ray.wait([pg.ready()], timeout=PLACEMENT_TIMEOUT_S)
        if not ready:
            raise LaunchError(f"{name}: Ray could not place {len(bundles)} bundle(s) of {bundles[0]} "
                              f"({self.config.strategy}) within {PLACEMENT_TIMEOUT_S:.0f}s; the cluster has "
                              f"{ray.available_resources()} free (scheduler.ray.cpus_per_process, the allocation)")
        return pg

    def _start(self, name: str, pg: PlacementGroup, index: int, cmd: list[str], env: dict[str, str],
               gpus: int) -> RayProcess:
        log, start = self._log_file(name, cmd)
        strategy = PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=index)
        actor = _RemoteHost.options(num_cpus=self.config.cpus_per_process, num_gpus=gpus, max_concurrency=4,
                                    scheduling_strategy=strategy, name=None).remote()
        # The controller's own environment stays on its node: only what the launch adds travels.
        extra = {k: v for k, v in env.items() if os.environ.get(k) != v}
        try:
            info = ray.get(actor.start.remote(cmd, extra, str(log)), timeout=_CALL_TIMEOUT_S)
        except Exception as exc:
            with contextlib.suppress(Exception):
                ray.kill(actor)
            raise LaunchError(f"{name}: its Ray actor could not start the process ({exc}); log {log}") from exc
        with self._lock:
            proc = RayProcess(name, actor, log, start, info)
            self.processes.append(proc)
        return proc

    def _launch_server(self, name: str, cmd: list[str], env: dict[str, str], devices: list[int],
                       device: str) -> LaunchedProcess:
        gpus = len(devices) if device == "cuda" else 0
        return self._start(name, self._group(name, self._bundles(1, gpus)), 0, cmd, env, gpus)

    def _launch_ranks(self, name: str, cmd: list[str], envs: list[dict[str, str]], devices: list[int],
                      device: str) -> list[LaunchedProcess]:
        gpus = 1 if device == "cuda" else 0
        pg = self._group(name, self._bundles(len(envs), gpus))
        return [self._start(f"{name}-rank{r}", pg, r, cmd, env, gpus) for r, env in enumerate(envs)]

    def _cleanup(self) -> None:
        for pg in self.placement_groups:
            with contextlib.suppress(Exception):
                remove_placement_group(pg)
        if self._started_ray:
            with contextlib.suppress(Exception):
                ray.shutdown()

    def __enter__(self) -> RayScheduler:
        return self

"""`ProcessScheduler`: what every scheduler shares once it can start one process somewhere.

A subclass says how a role's process starts (`_launch_server`, `_launch_ranks`, optionally
`_cleanup`) and hands back `LaunchedProcess` objects. Here, the same for all: servers healthy on
return, worker groups met at the rendezvous and wrapped as a `WorkerGroup`, startup deadlines,
failures quoting the log tail, placement in the log, and an idempotent teardown (`shutdown()`,
also from `atexit` and SIGINT/SIGTERM). See docs/launch.md, "The scheduler interface", "Teardown"."""

from __future__ import annotations

import abc
import atexit
import contextlib
import json
import logging
import os
import re
import secrets
import signal
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from multiprocessing.connection import wait
from pathlib import Path
from typing import Any

from tandem.config.alloc import Component
from tandem.launch.process import LaunchedProcess, last_error_line
from tandem.launch.rendezvous import ENV_CONNECT, RankRendezvous
from tandem.launch.rpc import WorkerGroup
from tandem.launch.rpc_server import ENV_AUTHKEY, ENV_NAME
from tandem.launch.scheduler import (
    ENV_SERVE_API_KEY,
    LaunchError,
    Scheduler,
    ServerHandle,
    server_layout,
    worker_layout,
)
from tandem.net import is_loopback

logger = logging.getLogger("tandem.launch")
LISTENING = re.compile(r"tandem serve: listening on http://(\[[^\]]+\]|[^:\s]+):(\d+)")
INTERRUPT_GRACE_S = 2.0  # SIGTERM -> SIGKILL delay when a signal tears the run down
_TICK_S = 0.05  # startup only: how often the log and /health are looked at (the wait is on the sentinel)


class ProcessScheduler(Scheduler):
    """Servers and worker groups over `_launch_server` / `_launch_ranks` (see the module docstring).

    `run_dir`: logs go to `<run_dir>/logs` (default: a new temporary directory). `host`: the
    controller's address as the processes reach it (127.0.0.1: this machine). `grace_s`: SIGTERM ->
    SIGKILL delay at teardown. `handle_signals`: tear down on SIGINT/SIGTERM (main thread only;
    previous handlers are restored and then run). `call_timeout_s`: default deadline of trainer RPC
    calls (None: none; crashes end calls regardless)."""

    def __init__(self, run_dir: str | Path | None = None, *, host: str = "127.0.0.1", grace_s: float = 10.0,
                 handle_signals: bool = True, env: Mapping[str, str] | None = None,
                 call_timeout_s: float | None = None, log_tail_lines: int = 40, python: str = sys.executable):
        self.run_dir = Path(run_dir) if run_dir is not None else Path(tempfile.mkdtemp(prefix="tandem-run-"))
        self.log_dir = self.run_dir / "logs"
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.host = host
        self.grace_s, self.call_timeout_s, self.log_tail_lines = grace_s, call_timeout_s, log_tail_lines
        self.python = python
        self.env = dict(env or {})
        self._authkey = secrets.token_bytes(32)  # per run: authenticates every RPC connection
        self._rendezvous: RankRendezvous | None = None
        self.processes: list[LaunchedProcess] = []  # what was started (an srun may run a whole group)
        self.roles: list[LaunchedProcess] = []  # one per server and trainer rank
        self.servers: list[ServerHandle] = []
        self.groups: list[WorkerGroup] = []
        self.teardown_s: float | None = None
        self._lock = threading.RLock()
        self._closing = self._closed = False
        self._prev_handlers: dict[int, Any] = {}
        atexit.register(self._atexit)
        if handle_signals:
            self._install_signal_handlers()

    # ---------------------------------------------------------------------- what subclasses say

    @abc.abstractmethod
    def _launch_server(self, name: str, cmd: list[str], env: dict[str, str], devices: list[int],
                       device: str) -> LaunchedProcess:
        """Start one server process running `cmd` (placed on some node, with `devices` of the
        allocation when `device` is cuda); register it in `self.processes`."""

    @abc.abstractmethod
    def _launch_ranks(self, name: str, cmd: list[str], envs: list[dict[str, str]], devices: list[int],
                      device: str) -> list[LaunchedProcess]:
        """Start one process per rank (`envs[r]` is rank r's environment); return one
        `LaunchedProcess` per rank, each with a sentinel of its own; register what was started in
        `self.processes`."""

    def _cleanup(self) -> None:
        """After every process was stopped: anything the scheduler itself holds (jobs, actors)."""

    # ------------------------------------------------------------------------------ servers

    def start_servers(self, alloc: Component | str | int, model_path: str | Path, *,
                      server_args: Sequence[str] = (), name: str = "rollout", device: str = "cpu",
                      timeout_s: float = 180.0, env: Mapping[str, str] | None = None,
                      api_key: str | None = None) -> list[ServerHandle]:
        layout = server_layout(alloc)
        if api_key:
            env = {**(env or {}), ENV_SERVE_API_KEY: api_key}
        bind = ["--host", self.host] if is_loopback(self.host) else ["--host-towards", self.host]
        procs: list[LaunchedProcess] = []
        try:
            for i, devices in enumerate(layout):
                cmd = [self.python, "-m", "tandem.cli", "serve", "--model", str(model_path), *bind, "--port", "0",
                       *server_args]
                if device != "cpu":
                    cmd += ["--device", device]
                procs.append(self._launch_server(f"{name}-{i}", cmd, self._env(env), devices, device))
                logger.info("%s: starting (log %s)", procs[-1].name, procs[-1].log_path)
            deadline = time.monotonic() + timeout_s
            handles = []
            for p in procs:
                handles.append(self._await_server(p, deadline, timeout_s))
                logger.info("%s: ready at %s after %.1f s (%s)", p.name, handles[-1].url, time.monotonic() - p.started,
                            p.placement)
        except BaseException:
            self._stop(procs, grace_s=min(self.grace_s, 5.0))
            raise
        self.servers.extend(handles)
        self.roles.extend(procs)
        return handles

    def _await_server(self, proc: LaunchedProcess, deadline: float, timeout_s: float) -> ServerHandle:
        host = port = None
        offset, seen = proc.log_start, ""  # this launch's lines only: a rerun appends to the same log
        while host is None:
            with contextlib.suppress(OSError), open(proc.log_path, "rb") as f:
                f.seek(offset)
                chunk = f.read()
                offset += len(chunk)
                seen = (seen + chunk.decode("utf-8", errors="replace"))[-8192:]
            if (m := LISTENING.search(seen)) is not None:
                host, port = m.group(1).strip("[]"), int(m.group(2))
                break
            self._startup_tick(proc, deadline, timeout_s, "did not print its listening line")
        url = f"http://{host}:{port}"
        while True:
            status, body = _get_json(f"{url}/health", timeout=max(0.1, min(2.0, deadline - time.monotonic())))
            if status == 200:
                return ServerHandle(proc.name, host, port, proc.pid, proc.log_path)
            if status == 503 and isinstance(body, dict) and body.get("status") == "broken":
                raise self._startup_error(proc, f"failed to start: {last_error_line(proc) or body.get('message')}")
            self._startup_tick(proc, deadline, timeout_s, f"did not become healthy ({url}/health)")

    def _startup_tick(self, proc: LaunchedProcess, deadline: float, timeout_s: float, what: str) -> None:
        """Wait a tick, ending early if the process dies; raise on death or a missed deadline."""
        left = deadline - time.monotonic()
        if left > 0:
            wait([proc.sentinel], min(_TICK_S, left))
        if proc.poll() is not None:
            raise self._startup_error(proc, f"exited during startup ({proc.exit_status()})")
        if time.monotonic() >= deadline:
            raise self._startup_error(proc, f"{what} within {timeout_s:.0f}s{proc.waiting_reason()}")

    def _startup_error(self, proc: LaunchedProcess, what: str) -> LaunchError:
        return LaunchError(proc.describe(what, self.log_tail_lines))

    # ------------------------------------------------------------------------------ workers

    def start_workers(self, alloc: Component | str | int, module: str, *, args: Sequence[str] = (),
                      name: str = "actor", device: str = "cpu", timeout_s: float = 180.0,
                      env: Mapping[str, str] | None = None) -> WorkerGroup:
        world, devices = worker_layout(alloc)
        rendezvous = self._rendezvous_listener()
        envs = []
        for rank in range(world):
            child_env = self._env(env)
            child_env.update({
                "RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(world),
                ENV_AUTHKEY: self._authkey.hex(), ENV_CONNECT: rendezvous.address, ENV_NAME: f"{name}-rank{rank}",
            })
            envs.append(child_env)
        procs: list[LaunchedProcess] = []
        try:
            procs = self._launch_ranks(name, [self.python, "-m", module, *args], envs, devices, device)
            logger.info("%s: starting %d rank(s) (logs %s)", name, world,
                        ", ".join(sorted({str(p.log_path) for p in procs})))

            def failure(rank: int, what: str) -> LaunchError:
                return self._startup_error(procs[rank], what + procs[rank].waiting_reason())

            conns, hellos = rendezvous.gather(procs, time.monotonic() + timeout_s, failure)
            for proc, hello in zip(procs, hellos, strict=True):
                proc.placed(hello.hostname, hello.host, hello.pid, hello.where)
            group = WorkerGroup(name, conns, procs, default_timeout_s=self.call_timeout_s,
                                log_tail_lines=self.log_tail_lines)
            group.master_port = hellos[0].port
            group.hosts = [h.host for h in hellos]
            logger.info("%s: %d rank(s) connected after %.1f s", name, world, time.monotonic() - procs[0].started)
        except BaseException:
            self._stop(procs, grace_s=min(self.grace_s, 5.0))
            raise
        self.groups.append(group)
        self.roles.extend(procs)
        return group

    def _rendezvous_listener(self) -> RankRendezvous:
        with self._lock:
            if self._closing:
                raise LaunchError("cannot start workers: the scheduler is shut down")
            if self._rendezvous is None:
                self._rendezvous = RankRendezvous(self.host, self._authkey)
            return self._rendezvous

    @property
    def rendezvous_address(self) -> str | None:
        """host:port where worker ranks meet the controller (None before the first group)."""
        return None if self._rendezvous is None else self._rendezvous.address

    def placement(self) -> list[tuple[str, str]]:
        """(role, where it runs) of every server and trainer rank started so far."""
        return [(p.name, p.placement) for p in self.roles]

    # ----------------------------------------------------------------------------- teardown

    def shutdown(self) -> None:
        self._teardown(graceful=True)

    def _teardown(self, graceful: bool) -> None:
        with self._lock:
            if self._closed:
                return
            if self._closing:  # re-entered (a signal during teardown): no more grace
                self._kill_now()
                return
            self._closing = True
        start = time.monotonic()
        if not graceful:
            logger.warning("interrupted: stopping %d process(es)", len(self.processes))
        try:
            for group in self.groups:
                with contextlib.suppress(Exception):
                    if graceful:
                        group.shutdown(timeout_s=min(self.grace_s, 3.0))
                    group.close()
            # Interrupted (Ctrl-C, SIGTERM): a short grace, so the run ends within seconds even
            # when a server is still finishing requests.
            self._stop(self.processes, self.grace_s if graceful else min(self.grace_s, INTERRUPT_GRACE_S))
            if self._rendezvous is not None:
                self._rendezvous.close()
            with contextlib.suppress(Exception):
                self._cleanup()
        finally:
            self._closed = True
            self.teardown_s = time.monotonic() - start
            logger.info("stopped %d process(es) in %.1f s", len(self.processes), self.teardown_s)
            self._restore_signal_handlers()
            atexit.unregister(self._atexit)

    def log_exits(self) -> list[LaunchedProcess]:
        """Log every started process that has exited (name, exit status, log and its last lines)
        and return them: what a failure report says about which role died."""
        dead = [p for p in self.processes if p.sentinel >= 0 and p.poll() is not None]
        for p in dead:
            logger.error("%s", p.describe(f"exited ({p.exit_status()})", self.log_tail_lines))
        return dead

    def _kill_now(self) -> None:
        for p in self.processes:
            p.signal_group(signal.SIGKILL)

    def _stop(self, procs: Sequence[LaunchedProcess], grace_s: float) -> None:
        """SIGTERM each process group, wait up to grace_s for the leaders (on their sentinels),
        SIGKILL the groups, reap. Never raises."""
        live = [p for p in procs if p.sentinel >= 0]
        for p in live:
            p.signal_group(signal.SIGTERM)
        end = time.monotonic() + grace_s
        pending = {p.sentinel: p for p in live if p.poll() is None}
        while pending and (left := end - time.monotonic()) > 0:
            for s in wait(list(pending), left):
                pending.pop(s, None)  # type: ignore[call-overload]
        for p in live:
            p.signal_group(signal.SIGKILL)  # stragglers, and anything the leader left in its group
        for p in live:
            p.reap(timeout_s=5.0)
        end = time.monotonic() + 2.0  # members of a group need a moment to vanish after SIGKILL
        while any(p.group_alive() for p in live) and time.monotonic() < end:
            time.sleep(0.01)
        for p in live:
            p.release()

    def _atexit(self) -> None:
        self._teardown(graceful=True)

    # ------------------------------------------------------------------------------ signals

    def _install_signal_handlers(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # signal handlers can only be set there; atexit and `with` still apply
        for sig in (signal.SIGINT, signal.SIGTERM):
            prev = signal.getsignal(sig)
            if prev is signal.SIG_IGN or prev is None:
                continue
            self._prev_handlers[sig] = prev
            signal.signal(sig, self._on_signal)

    def _restore_signal_handlers(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for sig, prev in self._prev_handlers.items():
            if signal.getsignal(sig) == self._on_signal:  # leave handlers installed after ours alone
                signal.signal(sig, prev)

    def _on_signal(self, signum: int, frame: Any) -> None:
        if self._closing and not self._closed:
            self._kill_now()
            return
        self._teardown(graceful=False)  # the main thread may be inside a call: no RPC now
        prev = self._prev_handlers.get(signum)
        if callable(prev):
            prev(signum, frame)  # e.g. default_int_handler raises KeyboardInterrupt
            return
        if signum == signal.SIGINT:
            raise KeyboardInterrupt
        raise SystemExit(128 + signum)

    # ------------------------------------------------------------------------------ helpers

    def _env(self, extra: Mapping[str, str] | None) -> dict[str, str]:
        env = {**os.environ, **self.env, **(extra or {})}
        env["PYTHONUNBUFFERED"] = "1"
        if is_loopback(self.host):
            # Everything talks over loopback: gloo's listeners (trainer group, weight group) bind
            # it, never the address the host name resolves to. Elsewhere each rank picks the
            # interface that reaches its group's master (`rendezvous.join_controller`).
            env.setdefault("GLOO_SOCKET_IFNAME", "lo")
        return env

    def _log_file(self, name: str, cmd: Sequence[str]) -> tuple[Path, int]:
        """`<run_dir>/logs/<name>.log` with this launch's first line (the command) appended, and
        where that line starts: earlier launches of the role keep their lines."""
        with self._lock:
            if self._closing:
                raise LaunchError(f"cannot start {name}: the scheduler is shut down")
        log = self.log_dir / f"{name}.log"
        with open(log, "ab") as f:
            start = f.tell()
            f.write(f"# {time.strftime('%Y-%m-%d %H:%M:%S')} {' '.join(cmd)}\n".encode())
        return log, start

    def __repr__(self) -> str:
        return f"{type(self).__name__}({str(self.run_dir)!r}, {len(self.processes)} processes)"


_NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # our servers never via a proxy


def _get_json(url: str, timeout: float) -> tuple[int | None, Any]:
    """(status, parsed body) of a GET; (None, None) when nothing answers yet."""
    try:
        with _NO_PROXY.open(url, timeout=timeout) as resp:
            raw = resp.read()
            status = resp.status
    except urllib.error.HTTPError as exc:
        status, raw = exc.code, exc.read()
    except (OSError, ValueError):
        return None, None
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, None

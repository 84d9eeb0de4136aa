"""`LocalScheduler`: inference servers and trainer workers as processes on this machine.

Process layout (see docs/launch.md):

    controller (this process)
    ├── rollout-0   python -m tandem.launch.guard PID -- python -m tandem.cli serve --port 0 ...
    ├── rollout-1   ...
    ├── actor-rank0 python -m tandem.train.worker   (the module the caller names; RANK=0, ...)
    └── actor-rank1 python -m tandem.train.worker   (RANK=1, ...)

- Every child starts in its own session, so its process group holds it and anything it spawns;
  teardown signals whole groups. Children also get SIGKILL from the kernel if the controller
  dies without tearing down (`tandem.launch.guard`).
- stdout and stderr of each child go to `<run_dir>/logs/<name>.log`; errors quote its last lines.
- Teardown (`shutdown()`, also run by `atexit` and on SIGINT/SIGTERM): trainer groups get a
  `shutdown` RPC when idle, then every process group gets SIGTERM, and SIGKILL after `grace_s`.
  Idempotent. A second Ctrl-C during teardown SIGKILLs at once.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import re
import secrets
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from multiprocessing.connection import Client, Connection, wait
from pathlib import Path
from typing import Any

from tandem.config.alloc import Component
from tandem.launch.process import ManagedProcess, free_port, last_error_line
from tandem.launch.rpc import WorkerGroup
from tandem.launch.rpc_server import ENV_AUTHKEY, ENV_NAME, ENV_PARENT_PID, ENV_READY_FD
from tandem.launch.scheduler import (
    ENV_SERVE_API_KEY,
    LaunchError,
    Scheduler,
    ServerHandle,
    server_layout,
    worker_layout,
)
from tandem.weights.shm import remove_stale_segments

logger = logging.getLogger(__name__)
LISTENING = re.compile(r"tandem serve: listening on http://(\[[^\]]+\]|[^:\s]+):(\d+)")
INTERRUPT_GRACE_S = 2.0  # SIGTERM -> SIGKILL delay when a signal tears the run down
_TICK_S = 0.05  # startup only: how often the log and /health are looked at (the wait is on the pidfd)


class LocalScheduler(Scheduler):
    """Processes on 127.0.0.1 (see the module docstring for layout, logs and teardown).

    `run_dir`: logs go to `<run_dir>/logs` (default: a new temporary directory).
    `grace_s`: SIGTERM -> SIGKILL delay at teardown. `handle_signals`: tear down on SIGINT/SIGTERM
    (main thread only; previous handlers are restored and then run). `call_timeout_s`: default
    deadline of trainer RPC calls (None: none; crashes end calls regardless)."""

    def __init__(self, run_dir: str | Path | None = None, *, grace_s: float = 10.0, handle_signals: bool = True,
                 env: Mapping[str, str] | None = None, call_timeout_s: float | None = None,
                 log_tail_lines: int = 40, python: str = sys.executable):
        self.run_dir = Path(run_dir) if run_dir is not None else Path(tempfile.mkdtemp(prefix="tandem-run-"))
        self.log_dir = self.run_dir / "logs"
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.grace_s, self.call_timeout_s, self.log_tail_lines = grace_s, call_timeout_s, log_tail_lines
        self.python = python
        self.env = dict(env or {})
        self._authkey = secrets.token_bytes(32)  # per run: authenticates every RPC connection
        self.processes: list[ManagedProcess] = []
        self.servers: list[ServerHandle] = []
        self.groups: list[WorkerGroup] = []
        self.teardown_s: float | None = None
        self._lock = threading.RLock()
        self._closing = self._closed = False
        self._prev_handlers: dict[int, Any] = {}
        atexit.register(self._atexit)
        if handle_signals:
            self._install_signal_handlers()

    # ------------------------------------------------------------------------------ servers

    def start_servers(self, alloc: Component | str | int, model_path: str | Path, *,
                      server_args: Sequence[str] = (), name: str = "rollout", device: str = "cpu",
                      timeout_s: float = 180.0, env: Mapping[str, str] | None = None,
                      api_key: str | None = None) -> list[ServerHandle]:
        layout = server_layout(alloc)
        if api_key:
            env = {**(env or {}), ENV_SERVE_API_KEY: api_key}
        procs: list[ManagedProcess] = []
        try:
            for i, devices in enumerate(layout):
                child_env = self._env(env)
                cmd = [self.python, "-m", "tandem.cli", "serve", "--model", str(model_path),
                       "--host", "127.0.0.1", "--port", "0", *server_args]
                if device != "cpu":
                    cmd += ["--device", device]
                    if device == "cuda":
                        child_env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, devices))
                procs.append(self._spawn(f"{name}-{i}", cmd, child_env, guard=True))
                logger.info("%s: starting (log %s)", procs[-1].name, procs[-1].log_path)
            deadline = time.monotonic() + timeout_s
            handles = []
            for p in procs:
                handles.append(self._await_server(p, deadline, timeout_s))
                logger.info("%s: ready at %s after %.1f s", p.name, handles[-1].url, time.monotonic() - p.started)
        except BaseException:
            self._stop(procs, grace_s=min(self.grace_s, 5.0))
            raise
        self.servers.extend(handles)
        return handles

    def _await_server(self, proc: ManagedProcess, deadline: float, timeout_s: float) -> ServerHandle:
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

    def _startup_tick(self, proc: ManagedProcess, deadline: float, timeout_s: float, what: str) -> None:
        """Wait a tick, ending early if the process dies; raise on death or a missed deadline."""
        left = deadline - time.monotonic()
        if left > 0:
            wait([proc.sentinel], min(_TICK_S, left))
        if proc.poll() is not None:
            raise self._startup_error(proc, f"exited during startup ({proc.exit_status()})")
        if time.monotonic() >= deadline:
            raise self._startup_error(proc, f"{what} within {timeout_s:.0f}s")

    def _startup_error(self, proc: ManagedProcess, what: str) -> LaunchError:
        return LaunchError(proc.describe(what, self.log_tail_lines))

    # ------------------------------------------------------------------------------ workers

    def start_workers(self, alloc: Component | str | int, module: str, *, args: Sequence[str] = (),
                      name: str = "actor", device: str = "cpu", timeout_s: float = 180.0,
                      env: Mapping[str, str] | None = None) -> WorkerGroup:
        world, devices = worker_layout(alloc)
        master_port = free_port()
        procs: list[ManagedProcess] = []
        ready: list[int] = []
        conns: list[Connection] = []
        try:
            for rank in range(world):
                r_fd, w_fd = os.pipe()
                ready.append(r_fd)
                child_env = self._env(env)
                child_env.update({
                    "RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
                    "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(master_port),
                    ENV_AUTHKEY: self._authkey.hex(), ENV_READY_FD: str(w_fd), ENV_PARENT_PID: str(os.getpid()),
                    ENV_NAME: f"{name}-rank{rank}",
                })
                if device == "cuda":
                    child_env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, devices))
                cmd = [self.python, "-m", module, *args]
                try:
                    procs.append(self._spawn(f"{name}-rank{rank}", cmd, child_env, pass_fds=(w_fd,)))
                finally:
                    os.close(w_fd)
            logger.info("%s: starting %d rank(s) (logs %s)", name, world,
                        ", ".join(str(p.log_path) for p in procs))
            ports = self._await_ready(procs, ready, time.monotonic() + timeout_s, timeout_s)
            for rank, port in enumerate(ports):
                try:
                    conns.append(Client(("127.0.0.1", port), authkey=self._authkey))
                except OSError as exc:
                    raise self._startup_error(procs[rank], f"refused the RPC connection ({exc}; "
                                              f"{procs[rank].exit_status(wait_s=2.0)})") from exc
            group = WorkerGroup(name, conns, procs, default_timeout_s=self.call_timeout_s,
                                log_tail_lines=self.log_tail_lines)
            group.master_port = master_port
            logger.info("%s: %d rank(s) connected after %.1f s", name, world, time.monotonic() - procs[0].started)
        except BaseException:
            for c in conns:
                c.close()
            self._stop(procs, grace_s=min(self.grace_s, 5.0))
            raise
        finally:
            for fd in ready:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self.groups.append(group)
        return group

    def _await_ready(self, procs: list[ManagedProcess], fds: list[int], deadline: float, timeout_s: float) -> list[int]:
        """Each rank writes its RPC port to its ready pipe once its process group is formed.
        Waits on the pipes and the pidfds together: any rank dying fails the start at once."""
        got: dict[int, bytes] = {r: b"" for r in range(len(procs))}
        ports: dict[int, int] = {}
        while len(ports) < len(procs):
            watch: dict[int, tuple[str, int]] = {}
            for r, p in enumerate(procs):
                if r not in ports:
                    watch[fds[r]] = ("ready", r)
                    watch[p.sentinel] = ("dead", r)
            left = deadline - time.monotonic()
            ready = wait(list(watch), max(0.0, left)) if left > 0 else []
            if not ready:
                late = [procs[r].name for r in range(len(procs)) if r not in ports]
                raise self._startup_error(procs[min(r for r in range(len(procs)) if r not in ports)],
                                          f"was not ready within {timeout_s:.0f}s (waiting for {late})")
            for fd in sorted(ready, key=lambda fd: watch[fd][0] != "ready"):
                kind, r = watch[fd]
                if r in ports:
                    continue
                if kind == "ready":
                    data = os.read(fd, 64)
                    got[r] += data
                    if b"\n" in got[r]:
                        ports[r] = int(got[r].split(b"\n", 1)[0])
                        continue
                    if data:
                        continue
                # EOF on the pipe without a port, or the process ended
                raise self._startup_error(procs[r], f"exited during startup ({procs[r].exit_status(wait_s=2.0)})")
        return [ports[r] for r in range(len(procs))]

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
            # A trainer killed here may leave weight segments that its resource tracker, killed
            # with its process group, did not get to unlink (tandem.weights.shm).
            with contextlib.suppress(OSError):
                remove_stale_segments(creators={p.pid for p in self.processes})
        finally:
            self._closed = True
            self.teardown_s = time.monotonic() - start
            logger.info("stopped %d process(es) in %.1f s", len(self.processes), self.teardown_s)
            self._restore_signal_handlers()
            atexit.unregister(self._atexit)

    def log_exits(self) -> list[ManagedProcess]:
        """Log every started process that has exited (name, exit status, log and its last lines)
        and return them: what a failure report says about which role died."""
        dead = [p for p in self.processes if p.sentinel >= 0 and p.poll() is not None]
        for p in dead:
            logger.error("%s", p.describe(f"exited ({p.exit_status()})", self.log_tail_lines))
        return dead

    def _kill_now(self) -> None:
        for p in self.processes:
            p.signal_group(signal.SIGKILL)

    def _stop(self, procs: Sequence[ManagedProcess], grace_s: float) -> None:
        """SIGTERM each process group, wait up to grace_s for the leaders (on their pidfds),
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
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.popen.wait(timeout=5.0)
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
        # Everything here talks over 127.0.0.1: gloo's listeners (trainer group, weight group) bind
        # the loopback interface, never the address the host name resolves to.
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")
        return env

    def _spawn(self, name: str, cmd: Sequence[str], env: Mapping[str, str], *, guard: bool = False,
               pass_fds: Sequence[int] = ()) -> ManagedProcess:
        with self._lock:
            if self._closing:
                raise LaunchError(f"cannot start {name}: the scheduler is shut down")
            if guard:
                cmd = [self.python, "-m", "tandem.launch.guard", str(os.getpid()), "--", *cmd]
            log = self.log_dir / f"{name}.log"
            with open(log, "ab") as f:  # appended: earlier launches of this role keep their lines
                start = f.tell()
                f.write(f"# {time.strftime('%Y-%m-%d %H:%M:%S')} {' '.join(cmd)}\n".encode())
            proc = ManagedProcess(name, cmd, log, env, pass_fds=pass_fds, log_start=start)
            self.processes.append(proc)
            return proc

    def __enter__(self) -> LocalScheduler:
        return self

    def __repr__(self) -> str:
        return f"LocalScheduler({str(self.run_dir)!r}, {len(self.processes)} processes)"


_NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # 127.0.0.1 never via a proxy


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

"""`LocalScheduler`: inference servers and trainer workers as processes on this machine.

Every child runs under `tandem.launch.guard` in its own session (teardown signals whole groups),
logs to `<run_dir>/logs/<name>.log`, and listens on 127.0.0.1. Startup, teardown and signals are
`ProcessScheduler`'s. Process layout and guarantees: docs/launch.md, "LocalScheduler"."""

from __future__ import annotations

import os
from pathlib import Path

from tandem.launch.process import LaunchedProcess, ManagedProcess
from tandem.launch.process_scheduler import ProcessScheduler
from tandem.launch.rpc_server import ENV_PARENT_PID
from tandem.weights.shm import remove_stale_segments


class LocalScheduler(ProcessScheduler):
    """Processes on 127.0.0.1; arguments as `ProcessScheduler`'s (no `host`: always loopback)."""

    def __init__(self, run_dir: str | Path | None = None, **kwargs: object):
        super().__init__(run_dir, host="127.0.0.1", **kwargs)  # type: ignore[arg-type]

    def _guarded(self, cmd: list[str]) -> list[str]:
        """`cmd` behind `tandem.launch.guard`: the parent-death signal is armed before `cmd`'s
        interpreter imports anything, so a child whose controller is SIGKILLed while it starts (torch
        takes seconds to import on a loaded machine) dies with it, not once its imports are done."""
        return [self.python, "-m", "tandem.launch.guard", str(os.getpid()), "--", *cmd]

    def _launch_server(self, name: str, cmd: list[str], env: dict[str, str], devices: list[int],
                       device: str) -> LaunchedProcess:
        if device == "cuda":
            env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, devices))
        return self._spawn(name, self._guarded(cmd), env)

    def _launch_ranks(self, name: str, cmd: list[str], envs: list[dict[str, str]], devices: list[int],
                      device: str) -> list[LaunchedProcess]:
        procs: list[LaunchedProcess] = []
        for rank, env in enumerate(envs):
            env[ENV_PARENT_PID] = str(os.getpid())
            if device == "cuda":
                env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, devices))
            procs.append(self._spawn(f"{name}-rank{rank}", self._guarded(cmd), env))
        return procs

    def _cleanup(self) -> None:
        # A trainer killed at teardown may leave weight segments that its resource tracker, killed
        # with its process group, did not get to unlink (tandem.weights.shm).
        remove_stale_segments(creators={p.pid for p in self.processes})

    def _spawn(self, name: str, cmd: list[str], env: dict[str, str]) -> ManagedProcess:
        log, start = self._log_file(name, cmd)
        with self._lock:
            proc = ManagedProcess(name, cmd, log, env, log_start=start)
            self.processes.append(proc)
        return proc

    def __enter__(self) -> LocalScheduler:
        return self

"""`ServerKeeper`: the launcher's side of an elastic fleet, for servers this run started.

A launched server that exits is evicted at once; with `rollout.replace_dead=true` a replacement
(a new port) joins like any server, at most `MAX_REPLACEMENTS_PER_SERVER` per launched server. The
pids of launched servers go to the membership (`tandem fleet`). `close()` gives a server the fleet
already evicted up to `EXIT_REPORT_WAIT_S` to exit, so the log says why it left. See docs/fleet.md,
"Elastic membership"."""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Sequence

from tandem.launch.process import LaunchedProcess
from tandem.launch.process_scheduler import ProcessScheduler
from tandem.launch.scheduler import ServerHandle
from tandem.launch.watch import ExitWatcher
from tandem.rollout.controller import RolloutController
from tandem.rollout.membership import MemberState

logger = logging.getLogger("tandem.run")

MAX_REPLACEMENTS_PER_SERVER = 3  # so a server that crashes at start-up does not loop
# `srun` ends some seconds after Slurm killed the job's server, so a failed call may evict it first.
EXIT_REPORT_WAIT_S = 10.0


class ServerKeeper:
    def __init__(self, scheduler: ProcessScheduler, controller: RolloutController, handles: Sequence[ServerHandle], *,
                 model_path: str, server_args: Sequence[str], device: str, api_key: str | None,
                 replace_dead: bool):
        self.scheduler, self.controller = scheduler, controller
        self.model_path, self.server_args, self.device, self.api_key = model_path, list(server_args), device, api_key
        self.replace_dead = replace_dead
        self.replacements = 0
        self._budget = MAX_REPLACEMENTS_PER_SERVER * len(handles)
        self._lock = threading.Lock()
        self._exit_told = threading.Condition(self._lock)  # notified as each exit is reported
        self._closed = False
        self._addresses: dict[str, str] = {}  # process name -> server URL
        self._told: set[str] = set()  # process names whose exit was reported
        self._watcher = ExitWatcher(self._on_exit)
        self._dead: queue.Queue[str | None] = queue.Queue()
        # One long-lived thread starts every replacement: a launched server is killed when the thread
        # that started it ends (`tandem.launch.guard`).
        self._replacer = threading.Thread(target=self._replace_loop, name="tandem-replace-servers", daemon=True)
        self._replacer.start()
        for handle in handles:
            self._watch(handle)

    def _watch(self, handle: ServerHandle) -> None:
        self._addresses[handle.name] = handle.url
        self.controller.fleet.membership.set_pid(handle.url, handle.pid)
        for proc in self.scheduler.processes:
            if proc.name == handle.name:
                self._watcher.add(proc)

    def _on_exit(self, proc: LaunchedProcess, status: str) -> None:
        with self._lock:
            if self._closed:
                return
            address = self._addresses.get(proc.name)
            replace = self.replace_dead and self._budget > 0
            if replace:
                self._budget -= 1
        if address is None:
            return
        logger.error("%s (%s) exited (%s); it leaves the fleet (log %s)", proc.name, address, status, proc.log_path)
        self.controller.fleet.evict(address, f"the process exited ({status})")
        with self._exit_told:
            self._told.add(proc.name)
            self._exit_told.notify_all()
        if replace:
            self._dead.put(proc.name)

    def _replace_loop(self) -> None:
        while (dead := self._dead.get()) is not None:
            self._replace(dead)

    def _replace(self, dead: str) -> None:
        name = f"{dead.rsplit('-r', 1)[0]}-r{self.replacements + 1}"
        try:
            handle = self.scheduler.start_servers(1, self.model_path, server_args=self.server_args, name=name,
                                                  device=self.device, api_key=self.api_key)[0]
        except Exception as exc:
            logger.error("could not start a replacement for %s: %s", dead, exc)
            return
        with self._lock:
            if self._closed:
                return
            self.replacements += 1
            self._watch(handle)
        url = self._addresses[handle.name]
        state = self.controller.join(url, handle.pid, listed=True)  # probed while evicted: a stop is not an exit
        logger.info("%s replaces %s at %s (%s)", handle.name, dead, url, state)

    def close(self) -> None:
        with self._exit_told:
            self._exit_told.wait_for(lambda: not self._evicted_but_untold(), EXIT_REPORT_WAIT_S)
            self._closed = True
        self._watcher.close()
        self._dead.put(None)
        self._replacer.join(5)

    def _evicted_but_untold(self) -> bool:
        """A launched server the fleet evicted whose exit has not been reported (yet). Under the
        lock (then the membership's)."""
        membership = self.controller.fleet.membership
        for proc in self.scheduler.processes:
            address = self._addresses.get(proc.name)
            if address is None or proc.name in self._told:
                continue
            record = membership.record(address)
            if record is not None and record.state is MemberState.EVICTED:
                return True
        return False

    def __enter__(self) -> ServerKeeper:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

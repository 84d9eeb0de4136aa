"""The scheduler interface: start inference servers and trainer worker groups, tear them down.

A `Scheduler` turns allocation components (`tandem:d2` -> two servers, `archon:d2` -> one trainer
group of two ranks) into running processes and hands back server addresses (`ServerHandle`) and an
RPC handle on the worker ranks (`WorkerGroup`); which module a worker rank runs is the caller's.
Implementations: `LocalScheduler`, `SlurmScheduler`, `RayScheduler`, all `ProcessScheduler`s.
Guarantees and an example: docs/launch.md, "The scheduler interface"."""

from __future__ import annotations

import abc
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from tandem.config.alloc import Component, parse_allocation
from tandem.errors import TandemError

if TYPE_CHECKING:
    from tandem.launch.rpc import WorkerGroup

# How a launcher hands `tandem serve` its API key: in the environment, which other local users
# cannot read (a command line they can, in /proc).
ENV_SERVE_API_KEY = "TANDEM_SERVE_API_KEY"
# Inference backends a scheduler starts itself; others (sglang, vllm) are used by address.
LAUNCHABLE_SERVERS = ("tandem",)


class LaunchError(TandemError, RuntimeError):
    """A process could not be started, died during startup, or missed its startup deadline."""


@dataclass(frozen=True)
class ServerHandle:
    """One running inference server."""

    name: str  # e.g. "rollout-0"
    host: str
    port: int
    pid: int | None
    log_path: Path | None

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def url(self) -> str:
        return f"http://{self.address}"


@dataclass(frozen=True)
class RunProcesses:
    """What a run will ask its scheduler for, all held at once: the inference servers it launches
    and its trainer ranks (every group's). A scheduler that brings its own resources, the private
    Ray of `RayScheduler`, is sized to hold them; the others do not need it."""

    servers: int = 0
    ranks: int = 0

    def __post_init__(self) -> None:
        if self.servers < 0 or self.ranks < 0:
            raise ValueError(f"RunProcesses: counts must be >= 0, got servers={self.servers}, ranks={self.ranks}")

    @property
    def count(self) -> int:
        return self.servers + self.ranks

    def describe(self) -> str:
        return f"{self.servers} server(s) + {self.ranks} trainer rank(s)"


def as_component(alloc: Component | str | int, *, inference: bool) -> Component | int:
    """A component from a component, a one-component allocation string, or a plain count."""
    if isinstance(alloc, str):
        mode = parse_allocation(alloc)
        parts = mode.inference if inference else mode.train
        if len(parts) != 1:
            kind = "inference" if inference else "training"
            raise LaunchError(f"{alloc!r} has {len(parts)} {kind} components; pass the one to start")
        return parts[0]
    return alloc


def server_layout(alloc: Component | str | int) -> list[list[int]]:
    """Device indices of each server: `tandem:d2t1` -> [[0], [1]] (dp servers of tp devices).
    Raises `LaunchError` for backends this scheduler does not start (`sglang`, `vllm`: pass their
    addresses instead) and for parallelism `tandem serve` does not have."""
    comp = as_component(alloc, inference=True)
    if isinstance(comp, int):
        if comp < 1:
            raise LaunchError(f"need at least one server, got {comp}")
        return [[i] for i in range(comp)]
    if not comp.is_inference:
        raise LaunchError(f"{comp.label!r} is a training component; start it with start_workers")
    if comp.backend not in LAUNCHABLE_SERVERS:
        raise LaunchError(f"{comp.backend!r} servers are not started by Tandem; run them yourself and give "
                          f"the controller their addresses (launchable here: {', '.join(LAUNCHABLE_SERVERS)})")
    if comp.run_error:
        raise LaunchError(comp.run_error)
    devs = list(comp.devices)
    return [[devs[i]] for i in range(comp.sizes.dp)]


def worker_layout(alloc: Component | str | int) -> tuple[int, list[int]]:
    """(world size, device indices) of a trainer group: `archon:d2` -> (2, [k, k+1])."""
    comp = as_component(alloc, inference=False)
    if isinstance(comp, int):
        if comp < 1:
            raise LaunchError(f"need at least one trainer rank, got {comp}")
        return comp, list(range(comp))
    if comp.is_inference:
        raise LaunchError(f"{comp.label!r} is an inference component; start it with start_servers")
    if comp.run_error:
        raise LaunchError(comp.run_error)
    return comp.sizes.world_size, list(comp.devices)


class Scheduler(abc.ABC):
    """Starts processes for allocation components and owns them until `shutdown`.

    Implementations guarantee: every process they started is gone after `shutdown()` (also when
    the controller is interrupted or fails), `shutdown()` is idempotent, and a process that dies or
    misses its deadline during startup raises `LaunchError` with the tail of its log."""

    @abc.abstractmethod
    def start_servers(self, alloc: Component | str | int, model_path: str | Path, *,
                      server_args: Sequence[str] = (), name: str = "rollout", device: str = "cpu",
                      timeout_s: float = 180.0, env: Mapping[str, str] | None = None,
                      api_key: str | None = None) -> list[ServerHandle]:
        """Start one `tandem serve` per data-parallel replica of `alloc` and return once every
        one answers `GET /health` with 200. `server_args` are extra `tandem serve` flags; with
        `api_key` every server requires it (handed over as `ENV_SERVE_API_KEY`)."""

    @abc.abstractmethod
    def start_workers(self, alloc: Component | str | int, module: str, *, args: Sequence[str] = (),
                      name: str = "actor", device: str = "cpu", timeout_s: float = 180.0,
                      env: Mapping[str, str] | None = None) -> WorkerGroup:
        """Start one SPMD worker group, `python -m module *args` per rank (RANK, WORLD_SIZE,
        LOCAL_RANK, MASTER_ADDR/PORT for one torch.distributed group, and the RPC bootstrap of
        `rpc_server` in its environment; `device="cuda"` also sets CUDA_VISIBLE_DEVICES), and
        return its RPC handle once every rank is connected. `module` is a module name, run as
        `-m` (never 'pkg.mod:function')."""

    @abc.abstractmethod
    def shutdown(self) -> None:
        """Stop everything this scheduler started. Idempotent; never raises."""

    def __enter__(self) -> Scheduler:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

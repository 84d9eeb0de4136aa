"""Fleets of scoring servers: frozen models that score what the policy generated (a teacher's
logprobs, a reward model's scores), beside the rollout fleet.

`ScoringFleetConfig` is what their config sections share (`teacher`, `reward_model`): the model,
servers launched by Tandem or listed, their deadlines. `ScoringFleet` is the client side: a pool, an
`InferenceClient` (retries across servers inside a deadline, as for generation) and an
`ElasticFleet` of its own (health probes, eviction; no weight updates, so a server that died is not
admitted again). A subclass's `ascore` is what the rollout executor awaits on every finished
episode (`tandem.rollout.executor.EpisodeScorer`). See docs/rewards.md."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from tandem.config.alloc import AllocationMode, parse_allocation_of_kind
from tandem.config.fields import check_field_metadata
from tandem.config.fields import config_field as _f
from tandem.data.trajectory import Trajectory
from tandem.errors import ConfigError
from tandem.fleet.ops import Deadlines
from tandem.launch.affinity import parse_cpus
from tandem.rollout.client import ClientConfig, InferenceClient
from tandem.rollout.elastic import ElasticFleet, FleetTooSmall
from tandem.rollout.health import HealthConfig
from tandem.rollout.pool import ServerPool

SCORING_SERVER_KINDS = ("tandem", "sglang")  # whose adapters map prompt logprobs and /classify


@dataclass
class ScoringFleetConfig:
    """The servers of one frozen scoring model (subclasses name the section and the model)."""

    SECTION: ClassVar[str] = ""
    LAUNCH_ARGS: ClassVar[tuple[str, ...]] = ()  # `tandem serve` options every launched server gets

    path: str = _f("", "HF directory of the model. Empty: none.")
    backend: str = _f("tandem:d1", "Its servers: 'tandem:dN' (launched by Tandem with the path) or 'sglang:dN' with "
                                   "servers (started by you).")
    servers: list[str] = field(default_factory=list, metadata={
        "help": "Addresses of its servers started elsewhere (host:port or URL); required for sglang."})
    server_args: list[str] = field(default_factory=list, metadata={
        "help": "Extra `tandem serve` options for its launched servers, e.g. ['--num-threads', '1']."})
    cpus: str = _f("", "Pin its launched servers to these cores, e.g. '1' (empty: no pinning).")
    api_key: str | None = _f(None, "Its servers' API key (launched ones: a fresh per-run key when empty).")
    min_servers: int = _f(1, "Scoring waits while fewer of its servers are healthy; after rollout.min_servers_grace_s "
                             "the run ends naming them.", min=1)
    request_deadline_s: float = _f(300.0, "Deadline of scoring one episode's sequence (all calls, retries, waits).",
                                   gt=0.0)
    call_timeout_s: float | None = _f(None, "Timeout of one scoring call (None: the deadline).", gt=0.0)

    @property
    def enabled(self) -> bool:
        return bool(self.path)

    @property
    def allocation(self) -> AllocationMode:
        return parse_allocation_of_kind(self.backend, f"{self.SECTION}.backend", inference=True)

    @property
    def server_kind(self) -> str:
        return self.allocation.components[0].backend

    @property
    def launched_by_tandem(self) -> bool:
        return self.server_kind == "tandem" and not self.servers

    def check(self, prefix: str) -> None:
        check_field_metadata(self, prefix)
        mode = parse_allocation_of_kind(self.backend, f"{prefix}backend", inference=True)
        if len(mode.components) != 1:
            raise ConfigError(f"{prefix}backend={self.backend!r} must name one inference component, e.g. 'tandem:d1'")
        comp = mode.components[0]
        if comp.backend not in SCORING_SERVER_KINDS:
            raise ConfigError(f"{prefix}backend={self.backend!r}: Tandem reads scores from "
                              f"{' and '.join(SCORING_SERVER_KINDS)} servers only (prompt logprobs, /classify); use "
                              f"{prefix}backend=tandem:d{comp.sizes.dp}")
        if comp.backend == "sglang" and not self.servers:
            raise ConfigError(f"{prefix}servers is empty: Tandem does not start sglang servers; list their addresses "
                              f"in {prefix}servers, or use {prefix}backend=tandem:dN")
        if self.launched_by_tandem and comp.run_error:
            raise ConfigError(f"{prefix}backend={self.backend!r}: {comp.run_error}")
        if self.cpus:
            try:
                parse_cpus(self.cpus)
            except ValueError as exc:
                raise ConfigError(f"{prefix}cpus: {exc}") from None
        starting = len(self.servers) if self.servers else comp.sizes.dp
        if self.min_servers > starting:
            raise ConfigError(f"{prefix}min_servers={self.min_servers} is more than the {starting} server(s) of "
                              f"{prefix.rstrip('.')} the run has; lower it or add servers")


class ScoringFleet:
    """A scoring model's servers at `addresses`, as the rollout controller holds them: `start`
    (health probes; `on_too_small` hears once when fewer than `min_servers` stayed healthy for
    `grace_s`), `stats`, `close`; `ascore` (subclasses) and `aclose` run on the executor's loop."""

    def __init__(self, addresses: list[str], config: ScoringFleetConfig, *, health: HealthConfig, grace_s: float,
                 deadlines: Deadlines, api_key: str | None = None):
        self.section = config.SECTION
        self.pool = ServerPool(addresses)
        self.client = InferenceClient(self.pool, ClientConfig(
            server_kind=config.server_kind, deadline_s=config.request_deadline_s,
            call_timeout_s=config.call_timeout_s, api_key=api_key))
        self.fleet = ElasticFleet(addresses, self.pool, self.client.adapter, health=health,
                                  min_servers=config.min_servers, min_servers_grace_s=grace_s, topology_cooldown_s=0.0,
                                  deadlines=deadlines, api_key=api_key, section=config.SECTION)
        self.scored = 0  # trajectories scored

    def start(self, on_too_small: Callable[[FleetTooSmall], None]) -> None:
        self.fleet.start(on_too_small)

    def close(self) -> None:
        self.fleet.close()

    def stats(self) -> dict[str, float]:
        """`<section>/healthy`, `evicted_total`, `resubmitted_total` and `scored_total`."""
        fleet = self.fleet.stats()
        return {f"{self.section}/healthy": fleet["fleet/healthy"],
                f"{self.section}/evicted_total": fleet["fleet/evicted_total"],
                f"{self.section}/resubmitted_total": float(self.client.resubmitted_total),
                f"{self.section}/scored_total": float(self.scored)}

    async def ascore(self, trajectories: list[Trajectory], item: Mapping[str, Any] | None = None) -> None:
        raise NotImplementedError

    async def aclose(self) -> None:
        await self.client.aclose()

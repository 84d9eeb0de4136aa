"""The teacher of on-policy distillation: a fleet of servers holding a frozen teacher model that
score the tokens the student sampled (prefill-only logprobs, `InferenceClient.ascore`).

A run with a teacher (`teacher.path`, `algo.distill.kl_coef > 0`) has the executor await
`TeacherScorer.ascore` on every finished episode: each trajectory gets `teacher_logprobs` before it
is accepted, so the teacher's scores travel with it (staleness, dumps, recovery). The fleet is
probed, evicts dead servers and retries a call on another server inside `teacher.request_deadline_s`
like generation; an episode whose scoring fails is a failed episode. See docs/rewards.md,
"Distillation"."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

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
from tandem.rollout.types import ScoreRequest

logger = logging.getLogger(__name__)

TEACHER_SERVER_KINDS = ("tandem", "sglang")  # whose adapters score a sequence's own tokens


@dataclass
class TeacherConfig:
    """The `teacher` section: the model whose per-token logprobs a student is distilled toward
    (`algo.distill.kl_coef`), and the servers that hold it."""

    path: str = _f("", "HF directory of the teacher (a causal LM with the actor's tokenizer). Empty: no teacher.")
    backend: str = _f("tandem:d1", "Teacher servers: 'tandem:dN' (launched by Tandem with teacher.path) or "
                                   "'sglang:dN' with teacher.servers (started by you).")
    servers: list[str] = field(default_factory=list, metadata={
        "help": "Addresses of teacher servers started elsewhere (host:port or URL); required for sglang."})
    server_args: list[str] = field(default_factory=list, metadata={
        "help": "Extra `tandem serve` options for launched teacher servers, e.g. ['--max-num-seqs', '64']."})
    cpus: str = _f("", "Pin launched teacher servers to these cores, e.g. '1' (empty: no pinning).")
    api_key: str | None = _f(None, "The teacher servers' API key (launched ones: a fresh per-run key when empty).")
    min_servers: int = _f(1, "Scoring waits while fewer teacher servers are healthy; after "
                             "rollout.min_servers_grace_s the run ends naming them.", min=1)
    request_deadline_s: float = _f(300.0, "Deadline of scoring one trajectory (all calls, retries, waits).", gt=0.0)
    call_timeout_s: float | None = _f(None, "Timeout of one scoring call (None: the deadline).", gt=0.0)

    @property
    def enabled(self) -> bool:
        return bool(self.path)

    @property
    def allocation(self) -> AllocationMode:
        return parse_allocation_of_kind(self.backend, "teacher.backend", inference=True)

    @property
    def server_kind(self) -> str:
        return self.allocation.components[0].backend

    @property
    def launched_by_tandem(self) -> bool:
        return self.server_kind == "tandem" and not self.servers

    def check(self, prefix: str = "teacher.") -> None:
        check_field_metadata(self, prefix)
        mode = parse_allocation_of_kind(self.backend, f"{prefix}backend", inference=True)
        if len(mode.components) != 1:
            raise ConfigError(f"{prefix}backend={self.backend!r} must name one inference component, e.g. 'tandem:d1'")
        comp = mode.components[0]
        if comp.backend not in TEACHER_SERVER_KINDS:
            raise ConfigError(f"{prefix}backend={self.backend!r}: teachers are scored with prompt logprobs, which "
                              f"Tandem reads from {' and '.join(TEACHER_SERVER_KINDS)} servers; use "
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
            raise ConfigError(f"{prefix}min_servers={self.min_servers} is more than the {starting} teacher server(s) "
                              f"the run has; lower it or add servers")


class TeacherScorer:
    """Scores trajectories with the teacher fleet at `addresses` (the executor's episode scorer).

    `start(on_too_small)` starts the health probes (`on_too_small` hears once when fewer than
    `min_servers` stayed healthy for `grace_s`); `ascore` runs on the executor's loop, `aclose` there
    at shutdown; `close` stops the probes."""

    def __init__(self, addresses: list[str], config: TeacherConfig, *, health: HealthConfig, grace_s: float,
                 deadlines: Deadlines, api_key: str | None = None):
        self.pool = ServerPool(addresses)
        self.client = InferenceClient(self.pool, ClientConfig(
            server_kind=config.server_kind, deadline_s=config.request_deadline_s,
            call_timeout_s=config.call_timeout_s, api_key=api_key))
        self.fleet = ElasticFleet(addresses, self.pool, self.client.adapter, health=health,
                                  min_servers=config.min_servers, min_servers_grace_s=grace_s, topology_cooldown_s=0.0,
                                  deadlines=deadlines, api_key=api_key, section="teacher")
        self.scored = 0  # trajectories scored
        self.tokens = 0  # generated tokens scored

    def start(self, on_too_small: Callable[[FleetTooSmall], None]) -> None:
        self.fleet.start(on_too_small)

    def close(self) -> None:
        self.fleet.close()

    def stats(self) -> dict[str, float]:
        """`teacher/healthy`, `teacher/evicted_total`, and the trajectories and tokens scored so far."""
        fleet = self.fleet.stats()
        return {"teacher/healthy": fleet["fleet/healthy"], "teacher/evicted_total": fleet["fleet/evicted_total"],
                "teacher/resubmitted_total": float(self.client.resubmitted_total),
                "teacher/scored_total": float(self.scored), "teacher/tokens_total": float(self.tokens)}

    async def ascore(self, trajectories: list[Trajectory]) -> None:
        """Set `teacher_logprobs` on each trajectory: the teacher's logprob of every token the
        policy generated (loss mask 1), 0.0 elsewhere; each trajectory is one scoring call from its
        first generated token on, the calls concurrent. Raises when one cannot be scored."""
        async with asyncio.TaskGroup() as tg:  # one failure cancels the rest: the episode fails
            for t in trajectories:
                tg.create_task(self._score(t))

    async def _score(self, trajectory: Trajectory) -> None:
        mask = trajectory.loss_mask
        out = [0.0] * len(mask)
        start = next((i for i, m in enumerate(mask) if m), None)
        if start is not None:
            if start == 0:
                raise ValueError("a trajectory whose first token is generated has no context for the teacher to "
                                 "score it from; every episode starts with a prompt")
            scores = await self.client.ascore(ScoreRequest(list(trajectory.input_ids), start))
            for offset, lp in enumerate(scores):
                if mask[start + offset]:
                    out[start + offset] = lp
            self.tokens += sum(mask)
        trajectory.teacher_logprobs = out
        self.scored += 1

    async def aclose(self) -> None:
        await self.client.aclose()

"""The `rollout` section: the inference fleet and the rollout controller (bounds, workers, callbacks).

`backend` is an allocation string (`tandem:d2`, `sglang:d4t2`, `vllm:d2`): Tandem launches `tandem`
servers itself, and vLLM servers with the interpreter `vllm.python` (docs/engines.md); SGLang
servers are started by the user and listed in `servers` (vLLM ones may be too). The wire
protocol follows from the backend (vLLM's OpenAI routes, or SGLang's native routes, which
`tandem serve` speaks too).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tandem.config.alloc import AllocationMode, parse_allocation_of_kind
from tandem.config.fields import check_field_metadata
from tandem.config.fields import config_field as _f
from tandem.errors import ConfigError
from tandem.fleet.adapters import Capabilities, adapter_for
from tandem.fleet.routed_experts import RoutedExpertLayout
from tandem.launch.affinity import parse_cpus
from tandem.launch.vllm import default_vllm_python
from tandem.rollout.agent.config import AgentConfig
from tandem.rollout.client import ClientConfig
from tandem.rollout.executor import ExecutorConfig
from tandem.rollout.health import HealthConfig
from tandem.sandbox.config import SandboxConfig
from tandem.user_code import absolute_spec

WORKFLOWS = ("rlvr", "multi_turn", "agent")


@dataclass
class MultiTurnConfig:
    """`rollout.workflow=multi_turn`: the model answers, the reward scores the answer; a wrong one
    (reward below `success_reward`) gets `retry_message` as the next user turn, until a right
    answer or `max_turns` answers."""

    max_turns: int = _f(2, "Model turns per episode at most (multi_turn workflow).", min=1)
    success_reward: float = _f(1.0, "A turn whose reward is at least this ends the episode (multi_turn workflow).")
    retry_message: str = _f("That is not right. Try again.",
                            "The user turn sent after an answer that scored below success_reward (multi_turn workflow).")


@dataclass
class VLLMLaunchConfig:
    """How Tandem starts vLLM servers (`rollout.backend=vllm:dN` without `rollout.servers`), and
    whether they (or listed ones) run Tandem's worker extension."""

    python: str | None = _f(None, "Interpreter with vLLM installed (None: .venv-vllm/bin/python, made by make vllm-venv).")
    max_model_len: int = _f(2048, "vLLM --max-model-len: prompt + output tokens of one request.", min=1)
    kv_cache_gib: int = _f(1, "VLLM_CPU_KVCACHE_SPACE (GiB) of the CPU build.", min=1)
    threads: int = _f(0, "OMP_NUM_THREADS of each vLLM server (0: vLLM's default).", min=0)
    args: list[str] = field(default_factory=list, metadata={"help": "Extra vLLM server options, e.g. ['--seed', '1']."})
    start_timeout_s: float = _f(300.0, "Seconds for a vLLM server to become healthy.", gt=0.0)
    enforce_eager: bool = _f(
        False, "Pass --enforce-eager: vLLM runs eagerly (starts faster, decodes slower). false: vLLM's default, "
        "its model compiled with torch.compile at start-up (the faster mode; docs/engines.md).")
    worker_extension: bool = _f(
        True, "The vLLM servers load Tandem's worker extension (--worker-extension-cls "
        "tandem.weights.vllm_worker.TandemWorkerExtension; passed to servers Tandem starts): weight sync over a "
        "group and staged commit. false: disk updates only, each applied on arrival.")
    lora_rank: int = _f(
        0, "The rank of the LoRA adapter the vLLM servers serve the policy as (--enable-lora; each update loads "
        "the adapter alone, named rollout.model or 'policy'): actor.lora.rank when tandem train trains LoRA with "
        "train.weight_sync=disk; 0: whole weights.", min=0)

    def interpreter(self) -> str:
        """`python`, else `.venv-vllm/bin/python` in the working directory; ConfigError naming
        the key when neither exists."""
        found = self.python or default_vllm_python()
        if found is None:
            raise ConfigError("rollout.vllm.python is not set and there is no .venv-vllm/bin/python here; run "
                              "`make vllm-venv` or set rollout.vllm.python to an interpreter that has vLLM")
        return found


@dataclass
class RolloutConfig:
    backend: str = _f("tandem:d1", "Inference allocation, e.g. 'tandem:d2' or 'vllm:d1' (launched by Tandem) or 'sglang:d4t2' (see tandem alloc).")
    servers: list[str] = field(
        default_factory=list,
        metadata={"help": "Addresses (host:port or URL) of servers started elsewhere; required for sglang (vllm: launched when empty)."},
    )
    server_args: list[str] = field(
        default_factory=list,
        metadata={"help": "Extra `tandem serve` options for launched servers, e.g. ['--max-num-seqs', '128']."},
    )
    cpus: str = _f("", "Pin launched servers to these cores, e.g. '0' (empty: no pinning).")
    model: str | None = _f(None, "vLLM served model name, when the server checks it.")
    api_key: str | None = _f(None, "The servers' API key (sent as 'Authorization: Bearer').")
    max_concurrent_rollouts: int = _f(64, "Episodes running at once.", min=1)
    consumer_batch_size: int = _f(8, "Episodes per training batch.", min=1)
    max_head_offpolicyness: int = _f(1, "Staleness bound: batches the fleet may run ahead of the trainer.", min=0)
    seed_sampling: bool = _f(False, "Seed every request from (experiment.seed, the item's stream position, sample "
                                    "index), so an item drawn again after a resume gets the same tokens.")
    max_consecutive_failures: int = _f(
        64, "End the run when this many episodes in a row failed (an error storm), with the first error.", min=1)
    order: str = _f("dispatch", "Hand-out order of accepted episodes.", choices=("dispatch", "completion"))
    workers: int = _f(0, "Rollout worker processes that run workflows (0: on the controller's loop).", min=0)
    request_deadline_s: float = _f(600.0, "Deadline of one generation request (all calls, retries, waits).", gt=0.0)
    call_timeout_s: float | None = _f(None, "Timeout of one HTTP generation call (None: the deadline).", gt=0.0)
    dump_dir: str | None = _f(None, "Write accepted trajectories as JSONL per version here (debugging).")
    workflow: str = _f("rlvr", "What one episode is: rlvr (gen.n_samples answers to a prompt, each scored by the "
                               "reward; one group), multi_turn (gen.n_samples conversations per prompt in which a "
                               "wrong answer is told so and answered again, see rollout.multi_turn) or agent.",
                       choices=WORKFLOWS)
    reward: str | None = _f(
        None, "The reward used instead of the task's, in training and evaluation: 'package.module:function' "
              "(importable) or 'path/to/file.py:function'; a relative file path is relative to the config file "
              "that sets it (on the command line: to the working directory). Called as fn(prompt_text, "
              "completion_text, prompt_ids, completion_ids, **item_fields) -> float in the reward worker processes "
              "(task.reward_workers, task.reward_timeout_s).",
        resolve=absolute_spec)
    multi_turn: MultiTurnConfig = field(default_factory=MultiTurnConfig)
    agent: AgentConfig = field(default_factory=AgentConfig)
    callback_host: str = _f("127.0.0.1", "Address the controller's callback server binds to.")
    callback_port: int = _f(0, "Port of the callback server (0: any free port).", min=0, max=65535)
    control_timeout_s: float = _f(30.0, "Timeout of one fleet control call (pause, continue, version) per server.",
                                  gt=0.0)
    worker_start_timeout_s: float = _f(120.0, "Seconds for rollout worker processes to start.", gt=0.0)
    health: HealthConfig = field(default_factory=HealthConfig)
    sandbox: SandboxConfig = field(default_factory=SandboxConfig)
    vllm: VLLMLaunchConfig = field(default_factory=VLLMLaunchConfig)
    min_servers: int = _f(1, "Rollouts start only with this many healthy servers at the current weights.", min=1)
    min_servers_grace_s: float = _f(
        60.0, "End the run when fewer than min_servers stayed healthy this long.", gt=0.0)
    topology_cooldown_s: float = _f(
        30.0, "Joining servers enter the weight-update group at most once per this many seconds.", min=0.0)
    replace_dead: bool = _f(False, "Restart a launched server that died (it rejoins through warm-up).")

    @property
    def allocation(self) -> AllocationMode:
        return parse_allocation_of_kind(self.backend, "rollout.backend", inference=True)

    @property
    def server_kind(self) -> str:
        """The kind of the servers (`tandem`, `sglang` or `vllm`): which adapter talks to them."""
        return self.allocation.components[0].backend

    @property
    def devices_per_server(self) -> int:
        """Devices of each server the run starts with (`backend`: `vllm:d1t2` -> 2), its ranks in a
        transfer group; servers that join later say their own."""
        return self.allocation.components[0].devices_per_server

    @property
    def launched_by_tandem(self) -> bool:
        """True when Tandem starts the servers (a `tandem` or `vllm` backend and no addresses given)."""
        return self.allocation.components[0].backend in ("tandem", "vllm") and not self.servers

    def check(self, prefix: str = "rollout.") -> None:
        """Raise ConfigError naming the field for a value outside its choices or floor, a bad
        allocation, or servers Tandem cannot start and that were not listed."""
        check_field_metadata(self, prefix)  # also for configs built in code, not loaded
        if self.cpus:
            try:
                parse_cpus(self.cpus)
            except ValueError as exc:
                raise ConfigError(f"{prefix}cpus: {exc}") from None
        mode = parse_allocation_of_kind(self.backend, f"{prefix}backend", inference=True)
        check_field_metadata(self.vllm, f"{prefix}vllm.")
        check_field_metadata(self.multi_turn, f"{prefix}multi_turn.")
        check_field_metadata(self.agent, f"{prefix}agent.")
        if self.workflow == "agent" and not self.agent.entry:
            raise ConfigError(f"{prefix}workflow=agent needs {prefix}agent.entry: the agent function, e.g. "
                              f"{prefix}agent.entry=tandem.agents.calculator:run or path/to/agent.py:run (docs/agents.md)")
        if self.workflow == "multi_turn" and self.seed_sampling:
            raise ConfigError(f"{prefix}seed_sampling=true seeds the samples of the rlvr workflow; "
                              f"{prefix}workflow=multi_turn does not seed its turns: set {prefix}seed_sampling=false "
                              f"or {prefix}workflow=rlvr")
        if len(mode.components) != 1:
            raise ConfigError(f"{prefix}backend={self.backend!r} must name one inference component, e.g. 'tandem:d2'")
        comp = mode.components[0]
        backend = comp.backend
        if self.launched_by_tandem and backend == "vllm" and comp.sizes.world_size > comp.sizes.dp * comp.sizes.tp:
            raise ConfigError(f"{prefix}backend={self.backend!r}: Tandem starts vLLM servers tensor-parallel only "
                              f"(--tensor-parallel-size); use vllm:d{comp.sizes.dp}t{comp.devices_per_server} or "
                              f"start them yourself and list {prefix}servers")
        if self.launched_by_tandem and comp.run_error:
            raise ConfigError(f"{prefix}backend={self.backend!r}: {comp.run_error}")
        starting = len(self.servers) if self.servers else comp.sizes.dp
        if self.min_servers > starting:
            raise ConfigError(
                f"{prefix}min_servers={self.min_servers} is more than the {starting} server(s) the run starts with "
                f"({prefix}backend={self.backend!r}{', ' + prefix + 'servers' if self.servers else ''}): rollouts "
                f"would wait for joiners and the run would end after {prefix}min_servers_grace_s; lower it or add servers")
        if backend == "sglang" and not self.servers:
            raise ConfigError(
                f"{prefix}servers is empty: Tandem does not start {backend} servers; start them and list their "
                f"addresses in {prefix}servers, or use {prefix}backend=tandem:dN or vllm:dN"
            )

    def capabilities(self) -> Capabilities:
        """What the servers can do (their kind's adapter, `tandem.fleet.adapters`)."""
        return adapter_for(self.server_kind, self.model, self.vllm.worker_extension, self.vllm.lora_rank > 0).capabilities

    def client_config(self, routed_expert_layout: RoutedExpertLayout | None = None) -> ClientConfig:
        """The inference client's config; `routed_expert_layout` (a MoE model's, routing replay r3) makes
        every generation ask for the routed experts."""
        return ClientConfig(
            server_kind=self.server_kind, model=self.model, vllm_extension=self.vllm.worker_extension,
            vllm_lora=self.vllm.lora_rank > 0,
            deadline_s=self.request_deadline_s,
            call_timeout_s=self.call_timeout_s, api_key=self.api_key, routed_expert_layout=routed_expert_layout,
        )

    def executor_config(self) -> ExecutorConfig:
        return ExecutorConfig(
            max_concurrent_rollouts=self.max_concurrent_rollouts, consumer_batch_size=self.consumer_batch_size,
            max_staleness=self.max_head_offpolicyness, order=self.order,  # type: ignore[arg-type]
            dump_dir=self.dump_dir, max_consecutive_failures=self.max_consecutive_failures,
        )

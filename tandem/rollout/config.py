"""The `rollout` section: what the rollout controller needs (servers, bounds, workers, callbacks).

Kept here (not in `tandem.config.schema`) until the controller is wired into the global schema;
fields carry the same `help` / `choices` / `min` metadata as the schema's sections.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from tandem.errors import ConfigError
from tandem.rollout.client import ClientConfig
from tandem.rollout.executor import ExecutorConfig


def _f(default: Any, help: str, **meta: Any) -> Any:
    return field(default=default, metadata={"help": help, **meta})


@dataclass
class RolloutConfig:
    servers: list[str] = field(default_factory=list, metadata={"help": "Inference server addresses (host:port or URL)."})
    backend: str = _f("native", "Server protocol.", choices=("native", "tandem", "sglang", "vllm"))
    model: str | None = _f(None, "vLLM served model name, when the server checks it.")
    api_key: str | None = _f(None, "The servers' API key (sent as 'Authorization: Bearer').")
    max_concurrent_rollouts: int = _f(64, "Episodes running at once.", min=1)
    consumer_batch_size: int = _f(8, "Episodes per training batch.", min=1)
    max_head_offpolicyness: int = _f(1, "Staleness bound: batches the fleet may run ahead of the trainer.", min=0)
    order: str = _f("dispatch", "Hand-out order of accepted episodes.", choices=("dispatch", "completion"))
    workers: int = _f(0, "Rollout worker processes that run workflows (0: on the controller's loop).", min=0)
    request_deadline_s: float = _f(600.0, "Deadline of one generation request (all calls, retries, waits).", min=0.0)
    call_timeout_s: float | None = _f(None, "Timeout of one HTTP generation call (None: the deadline).")
    dump_dir: str | None = _f(None, "Write accepted trajectories as JSONL per version here (debugging).")
    callback_host: str = _f("127.0.0.1", "Address the controller's callback server binds to.")
    callback_port: int = _f(0, "Port of the callback server (0: any free port).", min=0)
    control_timeout_s: float = _f(30.0, "Timeout of one fleet control call (pause, continue, version) per server.",
                                  min=0.0)
    worker_start_timeout_s: float = _f(120.0, "Seconds for rollout worker processes to start.", min=0.0)

    def check(self, prefix: str = "rollout.") -> None:
        """Raise ConfigError naming the field for a value outside its choices or floor."""
        for f in fields(self):
            value = getattr(self, f.name)
            choices, floor = f.metadata.get("choices"), f.metadata.get("min")
            if choices is not None and value not in choices:
                raise ConfigError(f"{prefix}{f.name}={value!r} is not one of {', '.join(map(str, choices))}")
            if floor is not None and value is not None and value < floor:
                raise ConfigError(f"{prefix}{f.name}={value!r} must be >= {floor}")
        if not self.servers:
            raise ConfigError(f"{prefix}servers is empty: give at least one inference server address")

    def client_config(self) -> ClientConfig:
        return ClientConfig(
            backend=self.backend, model=self.model, deadline_s=self.request_deadline_s,
            call_timeout_s=self.call_timeout_s, api_key=self.api_key,
        )

    def executor_config(self) -> ExecutorConfig:
        return ExecutorConfig(
            max_concurrent_rollouts=self.max_concurrent_rollouts, consumer_batch_size=self.consumer_batch_size,
            max_staleness=self.max_head_offpolicyness, order=self.order,  # type: ignore[arg-type]
            dump_dir=self.dump_dir,
        )

"""Configuration schemas: one dataclass per section of a Tandem YAML file.

Every field has a default, so a config file only states what differs. Field metadata carries the
help text shown in docs and, where a field takes one of a fixed set of values, its `choices`, and
`min` for a numeric floor; `tandem.config.loader` checks both and names the field on failure.
New sections (rollout workflow, algorithm, weight sync, ...) are added here as their issues land.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tandem.config.alloc import parse_allocation
from tandem.errors import AllocationError, ConfigError


def _f(default: Any, help: str, **meta: Any) -> Any:
    """A dataclass field with a default and metadata (help text, choices, min)."""
    return field(default=default, metadata={"help": help, **meta})


DTYPES = ("float32", "bfloat16", "float16")


@dataclass
class ExperimentConfig:
    name: str = _f("tandem", "Experiment name; outputs go to fileroot/name/trial.")
    trial: str = _f("trial0", "Trial name within the experiment.")
    seed: int = _f(1, "Seed for Python, NumPy and torch RNGs.", min=0)
    fileroot: str = _f("runs", "Root directory of logs, checkpoints and weight copies.")


@dataclass
class OptimizerConfig:
    type: str = _f("adamw", "Optimizer.", choices=("adamw",))
    lr: float = _f(1e-6, "Peak learning rate.", min=0.0)
    weight_decay: float = _f(0.01, "Decoupled weight decay.", min=0.0)
    beta1: float = _f(0.9, "Adam beta1.", min=0.0)
    beta2: float = _f(0.999, "Adam beta2.", min=0.0)
    eps: float = _f(1e-8, "Adam epsilon.", min=0.0)
    gradient_clipping: float = _f(1.0, "Max global grad norm (0 disables clipping).", min=0.0)
    lr_scheduler: str = _f(
        "constant", "Learning-rate schedule after warmup.", choices=("constant", "linear", "cosine")
    )
    warmup_steps_proportion: float = _f(0.0, "Fraction of total steps spent in linear warmup.", min=0.0)
    min_lr_ratio: float = _f(0.0, "Floor of the decayed learning rate, as a fraction of lr.", min=0.0)


@dataclass
class ActorConfig:
    path: str = _f("", "HF model directory (config.json + safetensors) the actor starts from.")
    dtype: str = _f("float32", "Parameter dtype of the training engine.", choices=DTYPES)
    backend: str = _f("archon:d1", "Training allocation, e.g. 'archon:d2' or 'archon:d2t2' (see tandem alloc).")
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)

    def check(self, prefix: str) -> None:
        check_backend(self.backend, f"{prefix}backend", inference=False)


@dataclass
class RolloutConfig:
    backend: str = _f("tandem:d1", "Inference allocation, e.g. 'tandem:d2' or 'sglang:d4t2' (see tandem alloc).")

    def check(self, prefix: str) -> None:
        check_backend(self.backend, f"{prefix}backend", inference=True)


@dataclass
class TandemConfig:
    experiment: ExperimentConfig = field(default_factory=ExperimentConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)


def check_backend(spec: str, key: str, inference: bool) -> None:
    """`key` must hold a valid allocation string whose components are all of the wanted kind."""
    try:
        mode = parse_allocation(spec)
    except AllocationError as exc:
        raise ConfigError(f"{key}: {exc}") from None
    if inference:
        wanted, wrong, example = "an inference allocation (sglang, vllm or tandem)", "a training", "tandem:d2"
    else:
        wanted, wrong, example = "a training allocation (archon or fsdp)", "an inference", "archon:d2"
    for comp in mode.components:
        if comp.is_inference != inference:
            raise ConfigError(f"{key}: {comp.backend!r} is {wrong} backend but {key} takes {wanted}, e.g. {example!r}")

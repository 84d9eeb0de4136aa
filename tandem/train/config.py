"""Configuration of the training engine (one dataclass per concern)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tandem.config.optimizer import OptimizerConfig
from tandem.errors import ConfigError
from tandem.parallel import ParallelizeConfig

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
PACKING = ("ffd", "kk")


def parse_dtype(name: str) -> torch.dtype:
    if name not in _DTYPES:
        raise ConfigError(f"dtype {name!r} is not supported; use one of {', '.join(_DTYPES)}")
    return _DTYPES[name]


@dataclass
class MicroBatchConfig:
    """How a rank splits its batch. The micro-batch count is the largest of: what
    `max_tokens_per_mb` needs, `n_mbs`, and every other DP rank's count; then rounded up to a
    multiple of `n_mbs_divisor` (e.g. the pipeline depth). `packing`: first-fit decreasing (fewest
    micro-batches under the budget) or Karmarkar–Karp (most even token counts)."""

    max_tokens_per_mb: int | None = None
    n_mbs: int = 1
    n_mbs_divisor: int = 1
    packing: str = "ffd"

    def __post_init__(self) -> None:
        if self.max_tokens_per_mb is not None and self.max_tokens_per_mb < 1:
            raise ConfigError(f"max_tokens_per_mb must be >= 1, got {self.max_tokens_per_mb}")
        if self.n_mbs < 1 or self.n_mbs_divisor < 1:
            raise ConfigError(f"n_mbs and n_mbs_divisor must be >= 1, got {self.n_mbs}, {self.n_mbs_divisor}")
        if self.packing not in PACKING:
            raise ConfigError(f"packing={self.packing!r}; choose one of {', '.join(PACKING)}")


@dataclass
class TrainEngineConfig:
    """Everything a `TrainEngine` needs besides the process group.

    `dtype` is the compute (FSDP param) dtype; master weights and optimizer state are float32.
    `device`: "cpu", "cuda", ... ; `backend`: None picks gloo for CPU, nccl for CUDA.
    `dp_shard=-1` shards over every rank; `dp_replicate > 1` gives HSDP.
    """

    path: str = ""
    dtype: str = "float32"
    device: str = "cpu"
    backend: str | None = None
    seed: int = 1
    deterministic: bool = False
    dp_shard: int = -1
    dp_replicate: int = 1
    activation_checkpoint: str = "none"
    ac_every: int = 1
    compile: bool = False
    reshard_after_forward: str = "default"
    total_train_steps: int = 1  # for the LR schedule's decay
    logprob_chunk_size: int = 1024  # tokens per output-head chunk in log-prob computation
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    mb: MicroBatchConfig = field(default_factory=MicroBatchConfig)

    def __post_init__(self) -> None:
        parse_dtype(self.dtype)
        if self.total_train_steps < 1:
            raise ConfigError(f"total_train_steps must be >= 1, got {self.total_train_steps}")
        if self.logprob_chunk_size < 1:
            raise ConfigError(f"logprob_chunk_size must be >= 1, got {self.logprob_chunk_size}")
        self.parallelize_config()  # validates the AC / reshard choices early

    def parallelize_config(self) -> ParallelizeConfig:
        return ParallelizeConfig(
            param_dtype=parse_dtype(self.dtype),
            reduce_dtype=torch.float32,
            activation_checkpoint=self.activation_checkpoint,
            ac_every=self.ac_every,
            compile=self.compile,
            reshard_after_forward=self.reshard_after_forward,
        )

"""Options for how a model is parallelised (what `ModelSpec.parallelize` receives)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tandem.errors import ConfigError

AC_MODES = ("none", "full", "selective")
RESHARD_POLICIES = ("default", "always", "never")


@dataclass
class ParallelizeConfig:
    """`param_dtype` is the compute dtype FSDP casts parameters to (master weights stay float32);
    gradients are reduced in `reduce_dtype`.

    Activation checkpointing: `none`; `full` recomputes every transformer block in backward;
    `selective` recomputes every `ac_every`-th block (trading memory for ~1/ac_every of the
    recompute). `reshard_after_forward`: `default` frees gathered block parameters after forward
    except for the last block (backward needs it at once); `always` / `never` as named.
    """

    param_dtype: torch.dtype = torch.float32
    reduce_dtype: torch.dtype = torch.float32
    activation_checkpoint: str = "none"
    ac_every: int = 1
    compile: bool = False
    reshard_after_forward: str = "default"

    def __post_init__(self) -> None:
        if self.activation_checkpoint not in AC_MODES:
            raise ConfigError(
                f"activation_checkpoint={self.activation_checkpoint!r}; choose one of {', '.join(AC_MODES)}"
            )
        if self.ac_every < 1:
            raise ConfigError(f"ac_every must be >= 1, got {self.ac_every}")
        if self.reshard_after_forward not in RESHARD_POLICIES:
            raise ConfigError(
                f"reshard_after_forward={self.reshard_after_forward!r}; choose one of "
                f"{', '.join(RESHARD_POLICIES)}"
            )

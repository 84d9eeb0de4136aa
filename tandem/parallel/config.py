"""Options for how a model is parallelised (what `ModelSpec.parallelize` receives besides the
dims, the mesh and the compute dtypes). Mounted in the run config as `actor.parallelize`."""

from __future__ import annotations

from dataclasses import dataclass

from tandem.config.fields import config_field as _f

AC_MODES = ("none", "full", "selective")
RESHARD_POLICIES = ("default", "always", "never")


@dataclass
class ParallelizeConfig:
    """Activation checkpointing, per-block compile and FSDP resharding. Checked by
    `tandem.config.fields.validate` (the training engine runs it on its whole config)."""

    activation_checkpoint: str = _f(
        "none", "Recompute activations in backward: every transformer block (full), or every ac_every-th "
        "one (selective).", choices=AC_MODES)
    ac_every: int = _f(1, "With selective checkpointing: every N-th block.", min=1)
    compile: bool = _f(False, "torch.compile each transformer block.")
    reshard_after_forward: str = _f(
        "default", "Free gathered block parameters after forward: default (all but the last block, which "
        "backward needs at once), always or never.", choices=RESHARD_POLICIES)

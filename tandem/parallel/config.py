"""Options for how a model is parallelised (what `ModelSpec.parallelize` receives besides the
dims, the mesh and the compute dtypes). Mounted in the run config as `actor.parallelize`."""

from __future__ import annotations

from dataclasses import dataclass

from tandem.config.fields import config_field as _f

AC_MODES = ("none", "full", "selective")
RESHARD_POLICIES = ("default", "always", "never")
# Pipeline schedules (torch.distributed.pipelining names) and AReaL's short names for them.
SCHEDULES = ("1F1B", "Interleaved1F1B", "InterleavedZeroBubble", "ZBVZeroBubble")
SHORT_NAMES = {"I1F1B": "Interleaved1F1B", "IZB": "InterleavedZeroBubble", "ZBV": "ZBVZeroBubble"}
PP_SCHEDULE_CHOICES = SCHEDULES + tuple(SHORT_NAMES)


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
        "backward needs at once; never under pipeline parallelism, where every micro-batch would gather "
        "again), always or never.", choices=RESHARD_POLICIES)
    pp_schedule: str = _f(
        "1F1B", "Pipeline schedule when pp > 1 (short names I1F1B, IZB, ZBV accepted).",
        choices=PP_SCHEDULE_CHOICES)
    pp_microbatches: int | None = _f(
        None, "Pipeline micro-batches per step, at least (raised to the number of stages, with a warning, "
        "when lower; None: the number of stages). Each is one engine micro-batch.", min=1)
    pp_stages_per_rank: int | None = _f(
        None, "Pipeline stages per rank (None: 1 for 1F1B, 2 for the interleaved and V schedules; "
        "ZBVZeroBubble needs exactly 2).", min=1)

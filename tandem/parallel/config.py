"""Options for how a model is parallelised (what `ModelSpec.parallelize` receives besides the
dims, the mesh and the compute dtypes). Mounted in the run config as `actor.parallelize`."""

from __future__ import annotations

from dataclasses import dataclass

from tandem.config.fields import config_field as _f
from tandem.errors import ConfigError

AC_MODES = ("none", "full", "selective", "memory_budget")
AC_SELECTIVE = ("layer", "op")
RESHARD_POLICIES = ("default", "always", "never")


@dataclass
class ParallelizeConfig:
    """Activation checkpointing, per-block compile and FSDP resharding and offload. Checked by
    `tandem.config.fields.validate` (the training engine runs it on its whole config)."""

    activation_checkpoint: str = _f(
        "none", "Recompute activations in backward: every transformer block (full); some of them "
        "(selective, see ac_selective); or as much as torch.compile's partitioner needs to keep "
        "ac_memory_budget of the activations (memory_budget, needs compile).", choices=AC_MODES)
    ac_selective: str = _f(
        "layer", "With selective checkpointing: every ac_every-th block (layer), or inside every block keep "
        "matmul and attention outputs and recompute the cheap elementwise ops and norms (op).",
        choices=AC_SELECTIVE)
    ac_every: int = _f(1, "With layer-level selective checkpointing: every N-th block.", min=1)
    ac_memory_budget: float = _f(
        0.5, "With memory_budget: the fraction of activation memory compile's partitioner may keep "
        "(0 recomputes all it can, 1 keeps everything).", min=0.0, max=1.0)
    compile: bool = _f(False, "torch.compile each transformer block.")
    reshard_after_forward: str = _f(
        "default", "Free gathered block parameters after forward: default (all but the last block, which "
        "backward needs at once), always or never.", choices=RESHARD_POLICIES)
    offload_params: bool = _f(
        False, "FSDP2 CPU offload: parameters, gradients and optimizer state live in host memory and move "
        "to the accelerator per block (accelerator runs only).")

    def check(self, prefix: str = "") -> None:
        if self.activation_checkpoint == "memory_budget" and not self.compile:
            raise ConfigError(f"{prefix}activation_checkpoint=memory_budget works through torch.compile's "
                              f"partitioner: set {prefix}compile=true (or choose full / selective)")

    def check_layout(self, tp: int, prefix: str = "") -> None:
        """Options that a parallel layout cannot run, refused with the reason. Under tensor
        parallelism, compile together with activation checkpointing fails inside torch (measured,
        torch 2.13: AOTAutograd cannot save the DeviceMesh a checkpointed DTensor block holds);
        each works with TP on its own."""
        if tp > 1 and self.compile and self.activation_checkpoint != "none":
            raise ConfigError(
                f"{prefix}compile=true with {prefix}activation_checkpoint={self.activation_checkpoint!r} is not "
                f"supported with tensor parallelism (tp={tp}): torch fails compiling checkpointed "
                f"tensor-parallel blocks; set {prefix}activation_checkpoint=none or {prefix}compile=false")

    def check_device(self, device_type: str, prefix: str = "") -> None:
        """Options that need an accelerator, refused on a CPU-only run with the reason."""
        if self.offload_params and device_type == "cpu":
            raise ConfigError(
                f"{prefix}offload_params=true needs an accelerator: FSDP2 offload keeps parameters in host "
                "memory and copies them to the device per block, and on a CPU run they are in host memory "
                f"already; set {prefix}offload_params=false")

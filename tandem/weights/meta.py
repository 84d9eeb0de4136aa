"""What a weight update is: its transport, where the bytes go, its version and its deadlines.
Built once per run from the config and copied per step with `for_version`."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from tandem.errors import ConfigError
from tandem.fleet.ops import Deadlines

UpdateType = Literal["disk", "distributed", "shm"]
UPDATE_TYPES: tuple[str, ...] = ("disk", "distributed", "shm")


@dataclass(frozen=True)
class WeightUpdateMeta:
    type: UpdateType
    path: str | None = None  # disk: root of versioned copies; shm: a name prefix (optional)
    bucket_bytes: int = 256 * 1024**2
    group_name: str = "weight_update_group"
    backend: str = "gloo"  # distributed: gloo (CPU) or nccl (GPU)
    master_address: str = "127.0.0.1"  # distributed: where trainer rank 0 hosts the group's store
    master_port: int = 0  # 0 = pick a free port when the group is formed
    version: int = 0
    deadlines: Deadlines = dataclasses.field(default_factory=Deadlines)
    warmup_dir: str | None = None  # where joining servers' warm-up copies go (None: joiners cannot be warmed)
    # LoRA: updates carry the adapter alone (PEFT tensors), which servers merge into their base
    # weights, with this alpha; None: whole weights (merged ones when the trainer has adapters).
    lora_alpha: float | None = None

    def __post_init__(self) -> None:
        if self.type not in UPDATE_TYPES:
            raise ConfigError(f"weight update type {self.type!r} is not one of {', '.join(UPDATE_TYPES)}")
        if self.type == "disk" and not self.path:
            raise ConfigError("a disk weight update needs `path`, the directory of versioned copies")
        if self.bucket_bytes <= 0:
            raise ConfigError(f"bucket_bytes must be positive, got {self.bucket_bytes}")
        if self.backend not in ("gloo", "nccl"):
            raise ConfigError(f"backend {self.backend!r} is not one of gloo, nccl")

    def for_version(self, version: int) -> WeightUpdateMeta:
        """The same update, for weights of `version` (the trainer's step after the update)."""
        return dataclasses.replace(self, version=version)

    @property
    def version_name(self) -> str:
        """The string servers echo in `meta_info.weight_version`."""
        return str(self.version)

    def warmup_path(self) -> Path:
        """The HF directory a joining server is warmed from, for this version."""
        if not self.warmup_dir:
            raise ConfigError("this weight update has no `warmup_dir`")
        return Path(self.warmup_dir) / f"warmup-v{self.version:08d}"

    def versioned_path(self) -> Path:
        """Disk: the HF directory that holds this version's weights."""
        if not self.path:
            raise ConfigError("this weight update has no `path`")
        return Path(self.path) / f"v{self.version:08d}"

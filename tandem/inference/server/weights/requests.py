"""The weight routes' requests as typed values: each `parse_*` reads one JSON body with the
protocol's checks (unknown fields refused, missing or mistyped fields named: ApiError 400; values
that are well-formed but unusable: ControlError) and returns what `WeightReceiver` takes.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tandem.inference.server.http_api import ApiError, ControlError, check_fields, get_field, get_version
from tandem.inference.server.weights.paths import check_weights_path
from tandem.weights import WeightGroupError, dtype_from_name

DEFAULT_GROUP = "weight_update_group"
STAGE_FIELDS = {"commit", "bucket_index", "lora_alpha"}


@dataclass(frozen=True)
class Stage:
    """Where a bucket goes: `commit` swaps its set in now (under `weight_version` when given,
    aborting in-flight requests first with `abort_all`); else it is staged, as bucket
    `bucket_index` of a multi-bucket set (None: a one-bucket set)."""

    commit: bool
    bucket_index: int | None
    weight_version: int | None
    abort_all: bool
    lora_alpha: float | None = None  # the tensors are a PEFT LoRA adapter with this alpha (merged into the base)


@dataclass(frozen=True)
class TensorMeta:
    """Names (HF), dtypes and shapes of one bucket's tensors, in order; never empty."""

    names: tuple[str, ...]
    dtypes: tuple[torch.dtype, ...]
    shapes: tuple[tuple[int, ...], ...]

    def meta_tensors(self) -> list[tuple[str, torch.Tensor]]:
        """The bucket as (name, meta tensor) pairs: checkable against the model, holding no data."""
        return [(n, torch.empty(s, dtype=d, device="meta"))
                for n, s, d in zip(self.names, self.shapes, self.dtypes, strict=True)]


@dataclass(frozen=True)
class DiskUpdate:
    """`/update_weights_from_disk`: an HF directory inside an allowed weights directory."""

    path: str
    stage: Stage


@dataclass(frozen=True)
class GroupJoin:
    """`/init_weights_update_group`: join as `rank` (>= 1; rank 0 is the trainer)."""

    address: str
    port: int
    rank: int
    world_size: int
    name: str
    backend: str
    timeout_s: float


@dataclass(frozen=True)
class FlatLayout:
    """A distributed bucket sent as one uint8 broadcast of `nbytes`; tensor k sits at `offsets[k]`."""

    offsets: tuple[int, ...]
    nbytes: int


@dataclass(frozen=True)
class DistributedBucket:
    """`/update_weights_from_distributed`: one broadcast per tensor, or one flat broadcast."""

    tensors: TensorMeta
    group_name: str
    flat: FlatLayout | None
    stage: Stage


@dataclass(frozen=True)
class SharedBucket:
    """`/update_weights_from_shm`: tensors at `offsets` of `source`, a /dev/shm segment name of
    `nbytes` (or, with `cuda_ipc`, a CUDA IPC handle). `zero_copy` (segments only): the trainer
    leaves the segment alone while this server serves from it."""

    tensors: TensorMeta
    offsets: tuple[int, ...]
    nbytes: int
    source: str
    cuda_ipc: bool
    zero_copy: bool
    stage: Stage


def parse_stage(body: dict[str, Any]) -> Stage:
    commit = get_field(body, "commit", bool, True)
    bucket_index = get_field(body, "bucket_index", int)
    if bucket_index is not None and bucket_index < 0:
        raise ApiError("field 'bucket_index' must be >= 0")
    lora_alpha = get_field(body, "lora_alpha", (int, float))
    if lora_alpha is not None and not lora_alpha > 0:
        raise ApiError(f"field 'lora_alpha' must be positive, got {lora_alpha}")
    return Stage(commit, bucket_index, get_version(body, "weight_version"),
                 get_field(body, "abort_all_requests", bool, False),
                 float(lora_alpha) if lora_alpha is not None else None)


def parse_tensor_meta(body: dict[str, Any]) -> TensorMeta:
    names = get_field(body, "names", list, required=True)
    dtypes = get_field(body, "dtypes", list, required=True)
    shapes = get_field(body, "shapes", list, required=True)
    if not (len(names) == len(dtypes) == len(shapes)) or not names:
        raise ControlError(f"names, dtypes and shapes must be non-empty lists of one length, got "
                           f"{len(names)}, {len(dtypes)}, {len(shapes)}")
    if not all(isinstance(n, str) for n in names) or not all(
        isinstance(s, list) and all(isinstance(d, int) and d >= 0 for d in s) for s in shapes
    ):
        raise ControlError("names must be strings and shapes lists of non-negative integers")
    try:
        torch_dtypes = tuple(dtype_from_name(d) for d in dtypes)
    except WeightGroupError as exc:
        raise ControlError(str(exc)) from exc
    return TensorMeta(tuple(names), torch_dtypes, tuple(tuple(s) for s in shapes))


def parse_disk(body: dict[str, Any], allowed_dirs: list[Path]) -> DiskUpdate:
    """403 (before anything looks at the path) unless `model_path` lies in `allowed_dirs`."""
    check_fields(body, {"model_path", "load_format", "abort_all_requests", "weight_version", "flush_cache", "commit"})
    path = get_field(body, "model_path", str, required=True)
    check_weights_path(path, allowed_dirs)
    load_format = get_field(body, "load_format", str, "auto")
    if load_format not in ("auto", "safetensors"):
        raise ApiError(f"load_format {load_format!r} is not supported; use 'auto' or 'safetensors'")
    return DiskUpdate(path, parse_stage(body))


def parse_join(body: dict[str, Any], device_type: str, default_timeout_s: float) -> GroupJoin:
    """The backend defaults to nccl on a CUDA server, gloo on CPU."""
    check_fields(body, {"master_address", "master_port", "rank_offset", "world_size", "group_name", "backend",
                        "timeout_s"})
    join = GroupJoin(
        address=get_field(body, "master_address", str, required=True),
        port=_integer(body, "master_port"),
        rank=_integer(body, "rank_offset"),
        world_size=_integer(body, "world_size"),
        name=get_field(body, "group_name", str, DEFAULT_GROUP),
        backend=get_field(body, "backend", str, "nccl" if device_type == "cuda" else "gloo"),
        timeout_s=float(get_field(body, "timeout_s", float, default_timeout_s)),
    )
    if not 0 < join.port < 65536:
        raise ControlError(f"master_port {join.port} is not a TCP port; send the port the trainer's store listens on")
    if not 1 <= join.rank < join.world_size:
        raise ControlError(f"rank_offset {join.rank} must be in [1, world_size={join.world_size}): rank 0 is the "
                           "trainer")
    if join.backend == "nccl" and device_type != "cuda":
        raise ControlError("backend 'nccl' needs a CUDA server; this one runs on CPU, use 'gloo'")
    if not 0 < join.timeout_s <= 86400:
        raise ControlError(f"timeout_s must be in (0, 86400], got {join.timeout_s}")
    return join


def _integer(body: dict[str, Any], name: str) -> int:
    """A required integer field, also as a numeric string (AReaL sends `"master_port": "12345"`;
    SGLang's request model coerces such strings)."""
    value = get_field(body, name, (int, str), required=True)
    if isinstance(value, str):
        if not value.strip().lstrip("+-").isdigit():
            raise ApiError(f"field {name!r} must be an integer or a string of one (e.g. 12345 or \"12345\"), "
                           f"got {value[:80]!r}")
        value = int(value.strip())
    return value


def parse_distributed(body: dict[str, Any]) -> DistributedBucket:
    check_fields(body, {"names", "dtypes", "shapes", "group_name", "flush_cache", "abort_all_requests",
                        "weight_version", "load_format", "offsets", "nbytes"} | STAGE_FIELDS)
    meta = parse_tensor_meta(body)
    flat = _flat_layout(body, len(meta.names))
    name = get_field(body, "group_name", str, DEFAULT_GROUP)
    stage = parse_stage(body)
    get_field(body, "flush_cache", bool, True)  # the prefix cache is always flushed after an update
    return DistributedBucket(meta, name, flat, stage)


def _flat_layout(body: dict[str, Any], count: int) -> FlatLayout | None:
    offsets = get_field(body, "offsets", list)
    nbytes = get_field(body, "nbytes", int)
    if offsets is None and nbytes is None:
        return None
    if offsets is None or nbytes is None or nbytes <= 0 or len(offsets) != count or not all(
            isinstance(o, int) and not isinstance(o, bool) for o in offsets):
        raise ControlError("a flat bucket needs 'offsets' (one integer per tensor) and a positive 'nbytes'")
    return FlatLayout(tuple(offsets), nbytes)


def parse_shared(body: dict[str, Any], device_type: str) -> SharedBucket:
    check_fields(body, {"names", "dtypes", "shapes", "offsets", "segment", "cuda_ipc", "nbytes", "flush_cache",
                        "abort_all_requests", "weight_version", "zero_copy"} | STAGE_FIELDS)
    meta = parse_tensor_meta(body)
    offsets = get_field(body, "offsets", list, required=True)
    nbytes = get_field(body, "nbytes", int, required=True)
    segment = get_field(body, "segment", str)
    handle = get_field(body, "cuda_ipc", str)
    zero_copy = get_field(body, "zero_copy", bool, False) and segment is not None
    stage = parse_stage(body)
    if len(offsets) != len(meta.names) or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets):
        raise ControlError("offsets must be a list of integers, one per tensor")
    if (segment is None) == (handle is None):
        raise ControlError("send exactly one of 'segment' (host shared memory) and 'cuda_ipc'")
    if handle is not None and device_type != "cuda":
        raise ControlError("'cuda_ipc' needs a CUDA server; this one runs on CPU, use 'segment'")
    return SharedBucket(meta, tuple(offsets), nbytes, segment if segment is not None else handle,
                        cuda_ipc=handle is not None, zero_copy=zero_copy, stage=stage)

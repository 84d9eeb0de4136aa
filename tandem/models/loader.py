"""Build, load and save native models from and to HF model directories."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tandem.errors import CheckpointError, ModelConfigError
from tandem.models.hf_checkpoint import (
    DEFAULT_MAX_SHARD_BYTES,
    iter_hf_tensors,
    read_hf_config,
    read_tensor_shapes,
    save_hf_checkpoint,
)
from tandem.models.registry import get_model_spec

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def config_dtype(hf_config: dict[str, Any]) -> torch.dtype:
    """The dtype a config.json declares (`dtype`, or legacy `torch_dtype`); float32 if none."""
    name = hf_config.get("dtype") or hf_config.get("torch_dtype") or "float32"
    name = str(name).removeprefix("torch.")
    if name not in _DTYPES:
        raise ModelConfigError(f"config dtype {name!r} is not supported; use one of {sorted(_DTYPES)}")
    return _DTYPES[name]


def build_model(
    hf_config: dict[str, Any],
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    seed: int | None = None,
) -> nn.Module:
    """A model for `hf_config`. On "meta" it stays uninitialised (shapes only, no memory);
    anywhere else it is materialised there and randomly initialised (`init_weights(seed)`)."""
    spec = get_model_spec(hf_config.get("model_type"))
    args = spec.args_from_hf_config(hf_config)
    with torch.device("meta"):
        model = spec.model_cls(args, hf_config)
    model.to(dtype=dtype)
    if torch.device(device).type != "meta":
        model.to_empty(device=device)
        model.tie_weights()
        model.init_weights(seed)
    return model


def load_model(
    path: str | os.PathLike[str],
    dtype: torch.dtype | None = torch.float32,
    device: torch.device | str = "cpu",
) -> nn.Module:
    """Load an HF directory (Qwen2/Qwen3 ...) into a native model; `dtype=None` keeps the config's."""
    hf_config = read_hf_config(path)
    if dtype is None:
        dtype = config_dtype(hf_config)
    model = build_model(hf_config, dtype=dtype, device="meta")
    model.to_empty(device=device)
    model.tie_weights()
    load_hf_weights(model, path)
    return model


@torch.no_grad()
def load_hf_weights(model: nn.Module, path: str | os.PathLike[str]) -> None:
    """Copy an HF checkpoint into `model`'s parameters (cast to their dtype), strictly: every
    parameter must be filled, every tensor used (bar known-harmless ones), shapes must match."""
    adapter = model.spec.state_dict_adapter_cls(model.args)
    params = dict(model.named_parameters())  # tied weights appear once, under the embedding name
    wanted = {piece: name for name, p in params.items() for piece in adapter.pieces(name, p.shape)}
    plan: dict[str, tuple[str, int | None]] = {}
    unexpected: list[str] = []
    mismatched: list[str] = []
    for hf_name, (shape, file) in read_tensor_shapes(path).items():
        try:
            piece = adapter.hf_to_piece(hf_name)
        except CheckpointError:
            unexpected.append(hf_name)
            continue
        if piece is None:
            continue
        native, index = piece
        if native not in params or (hf_name, index) not in wanted:
            unexpected.append(hf_name)
            continue
        expected = tuple(params[native].shape if index is None else params[native].shape[1:])
        if expected != shape:
            mismatched.append(f"{hf_name} (expected {expected}, got {shape} in {file.name})")
        else:
            plan[hf_name] = piece
    missing = sorted(hf for hf, _ in wanted.keys() - {(hf, index) for hf, (_, index) in plan.items()})
    problems = []
    if missing:
        problems.append(f"missing tensors: {', '.join(missing)}")
    if unexpected:
        problems.append(f"unexpected tensors: {', '.join(sorted(unexpected))}")
    if mismatched:
        problems.append(f"shape mismatch: {'; '.join(sorted(mismatched))}")
    if problems:
        raise CheckpointError(
            f"checkpoint {str(path)!r} does not fit its config.json ({model.args.model_type}): "
            + " | ".join(problems)
        )
    for hf_name, tensor in iter_hf_tensors(path, names=plan):
        native, index = plan[hf_name]
        (params[native] if index is None else params[native][index]).copy_(tensor)
    model.tie_weights()


def save_model(
    model: nn.Module,
    out_dir: str | os.PathLike[str],
    *,
    tokenizer_dir: str | os.PathLike[str] | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    overwrite: bool = False,
) -> Path:
    """Write `model` as an HF directory that `transformers.AutoModelForCausalLM` loads."""
    spec = model.spec
    adapter = spec.state_dict_adapter_cls(model.args)
    hf_sd = adapter.to_hf(model.state_dict())
    config = dict(model.hf_config)
    config["architectures"] = [spec.hf_architecture(model.args)]
    config["model_type"] = model.args.model_type
    return save_hf_checkpoint(
        out_dir,
        config,
        hf_sd,
        tokenizer_dir=tokenizer_dir,
        max_shard_bytes=max_shard_bytes,
        overwrite=overwrite,
    )

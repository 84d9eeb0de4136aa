"""Checkpoints of a (sharded) training engine.

- HF weights: parameters are gathered one at a time, in the same order on every rank, and rank 0
  streams them into safetensors shards; no rank ever holds more than one output shard plus one
  gathered tensor. The result is a plain HF directory (`transformers` loads it).
- Training state: weights, AdamW state, LR schedule, step and RNG, saved with
  `torch.distributed.checkpoint` (each rank writes its own shards, in parallel; loading reshards,
  so a state may be resumed at another world size). Per-rank RNG states go to small side files.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from tandem.errors import CheckpointError
from tandem.models.hf_checkpoint import DEFAULT_MAX_SHARD_BYTES, save_hf_checkpoint_stream
from tandem.train.dist import rng_state, set_rng_state
from tandem.train.weight_export import iter_hf_tensors_from_model

TRAIN_STATE_FILE = "train_state.pt"
# Optimizer state keyed by parameter name, param groups included: unflattened, each rank's group
# would be saved under the same `param_groups.0.params` key, which pipeline stages (ranks holding
# different parameters) would overwrite on one another.
# Frozen parameters (LoRA's base weights) are not saved: they are the run's starting checkpoint.
_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True, ignore_frozen_params=True)
# Setting it back leaves the frozen parameters as they are; `dcp.load` has already failed on any
# saved (trainable) tensor the checkpoint lacks.
_SET_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True, ignore_frozen_params=True, strict=False)


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def save_hf_weights(
    model: nn.Module,
    out_dir: str | os.PathLike[str],
    *,
    dtype: torch.dtype | None = None,
    tokenizer_dir: str | os.PathLike[str] | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    overwrite: bool = False,
    tensors: Iterable[tuple[str, torch.Tensor]] | None = None,
) -> Path:
    """Write `model` (native, possibly FSDP-sharded) as an HF directory. Collective.
    `tensors`: the `(hf_name, full tensor)` stream to write (on rank 0; consumed on every rank),
    when the model's own parameters are not the whole model (a pipeline stage)."""
    out = Path(out_dir)
    # Checked on every rank before any gather: a rank-0-only failure would leave the others
    # blocked in the first collective.
    if out.exists() and (not out.is_dir() or (any(out.iterdir()) and not overwrite)):
        raise CheckpointError(f"{str(out)!r} exists and is not empty; pass overwrite=True or choose another path")
    if tensors is None:
        tensors = iter_hf_tensors_from_model(model, dtype, dst=0)  # rank 0 writes; shards travel to it alone
    if _rank() == 0:
        config = dict(model.hf_config)
        config["architectures"] = [model.spec.hf_architecture(model.args)]
        config["model_type"] = model.args.model_type
        save_hf_checkpoint_stream(
            out, config, tensors, tokenizer_dir=tokenizer_dir, max_shard_bytes=max_shard_bytes, overwrite=overwrite
        )
    else:
        for _ in tensors:  # join every gather; rank 0 writes
            pass
    _barrier()
    return out


def _trainable_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
    """Model and optimizer state dicts of the trainable parameters. A frozen weight tied to
    another name (the output head sharing a frozen embedding) is dropped under that name too."""
    model_sd, optim_sd = get_state_dict(model, optimizer, options=_OPTIONS)
    frozen = {n for n, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad}
    return {k: v for k, v in model_sd.items() if k not in frozen}, optim_sd


def save_train_state(
    path: str | os.PathLike[str], model: nn.Module, optimizer: torch.optim.Optimizer, extra: dict[str, Any]
) -> Path:
    """Sharded save of weights + optimizer (DCP), `extra` (e.g. step, LR schedule; identical on
    all ranks) and every rank's RNG state. Collective."""
    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)
    model_sd, optim_sd = _trainable_state(model, optimizer)
    dcp.save({"model": model_sd, "optimizer": optim_sd}, checkpoint_id=str(root))
    if _rank() == 0:
        torch.save(extra, root / TRAIN_STATE_FILE)
    torch.save(rng_state(), root / f"rng-rank{_rank()}.pt")
    _barrier()
    return root


def load_train_state(
    path: str | os.PathLike[str], model: nn.Module, optimizer: torch.optim.Optimizer
) -> dict[str, Any]:
    """Restore what `save_train_state` wrote into `model` and `optimizer` (in place) and this
    rank's RNG (when saved at this rank); returns `extra`. Collective."""
    root = Path(path)
    if not (root / TRAIN_STATE_FILE).is_file():
        raise CheckpointError(f"{str(root)!r} is not a training-state checkpoint (no {TRAIN_STATE_FILE})")
    model_sd, optim_sd = _trainable_state(model, optimizer)
    state = {"model": model_sd, "optimizer": optim_sd}
    dcp.load(state, checkpoint_id=str(root))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"],
                   options=_SET_OPTIONS)
    rng_file = root / f"rng-rank{_rank()}.pt"
    if rng_file.is_file():
        set_rng_state(torch.load(rng_file, weights_only=False))
    return torch.load(root / TRAIN_STATE_FILE, weights_only=False)

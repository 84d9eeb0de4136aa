"""Loading an HF checkpoint into sharded (DTensor) parameters without a full model anywhere.

Each rank reads each tensor (memory-mapped safetensors, one at a time) and keeps only the slice its
parameter's placements give it: no communication; FSDP, tensor- and expert-parallel shards alike.
HF tensors are *pieces* of native parameters (`StateDictAdapter.hf_to_piece`; a stacked expert
weight `[E, ...]` is E pieces), and a piece fills only the part of the local tensor it overlaps."""

from __future__ import annotations

import os
from collections.abc import Collection

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from tandem.errors import CheckpointError
from tandem.models.common.lora import adapter_parameters, is_adapter_param, parse_peft_name, read_adapter
from tandem.models.hf_checkpoint import iter_hf_tensors, read_tensor_shapes


def _load_into(param: torch.Tensor, full: torch.Tensor) -> None:
    full = full.to(device=param.device, dtype=param.dtype)
    if isinstance(param, DTensor):
        # src_data_rank=None: every rank has the full tensor and slices it locally.
        param.copy_(distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None))
    else:
        param.copy_(full)


def _load_piece(param: torch.Tensor, index: int, piece: torch.Tensor) -> None:
    """Copy `piece` (= `param[index]` of the global parameter) into this rank's local part of it,
    if any: the local tensor of a DTensor is one box of the global tensor (its offset and shape)."""
    if not isinstance(param, DTensor):
        param[index].copy_(piece.to(device=param.device, dtype=param.dtype))
        return
    local = param.to_local()
    shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    if tuple(local.shape) != tuple(shape):
        raise AssertionError(f"local shard {tuple(local.shape)} of a {tuple(param.shape)} parameter is not the "
                             f"box {tuple(shape)} its placements {param.placements} give")
    row = index - offset[0]
    if not 0 <= row < shape[0]:
        return  # another rank's expert
    box = tuple(slice(o, o + n) for o, n in zip(offset[1:], shape[1:], strict=True))
    local[row].copy_(piece[box].to(device=local.device, dtype=local.dtype))


@torch.no_grad()
def load_hf_weights_sharded(model: nn.Module, path: str | os.PathLike[str], *, partial: bool = False,
                            aliases: dict[str, str] | None = None, zero_fill: Collection[str] = ()) -> None:
    """Strict: every parameter filled (every piece of a stacked one), every tensor used (bar ones
    the adapter skips, such as a tied `lm_head`), shapes equal to the parameters' global shapes.

    `partial` (a pipeline stage's model): tensors of parameters the model does not hold are
    skipped. `aliases`: native name -> the native name whose HF tensor fills it too (a pipeline
    stage's own copy of a tied weight, `output.weight` -> `tok_embeddings.weight`). `zero_fill`:
    native names of parameters the checkpoint does not hold; they are set to zero (a critic's
    value head when it starts from a causal LM). LoRA adapters are not HF tensors: `load_adapter` fills them."""
    adapter = model.spec.state_dict_adapter_cls(model.args)
    params = dict(model.named_parameters())  # tied weights once, under the embedding's name
    sources = {n: n for n in params} | {n: src for n, src in (aliases or {}).items() if n in params}
    wanted: dict[str, list[str]] = {}
    for native, source in sources.items():
        wanted.setdefault(source, []).append(native)
    plan: dict[str, tuple[list[str], int | None]] = {}
    problems: list[str] = []
    for hf_name, (shape, file) in read_tensor_shapes(path).items():
        try:
            piece = adapter.hf_to_piece(hf_name)
        except CheckpointError:
            piece = ("", None)
        if piece is None:
            continue
        native, index = piece
        if native not in wanted:
            if not partial:
                problems.append(f"unexpected tensor {hf_name}")
            continue
        target = params[wanted[native][0]]
        expected = tuple(target.shape if index is None else target.shape[1:])
        if index is not None and not 0 <= index < target.shape[0]:
            problems.append(f"{hf_name}: piece {index} of {native}, which has {target.shape[0]}")
        elif expected != shape:
            problems.append(f"{hf_name}: shape {shape} in {file.name}, model has {expected}")
        else:
            plan[hf_name] = (wanted[native], index)
    needed = {(hf, index): n for n in params if n not in zero_fill and not is_adapter_param(n)
              for hf, index in adapter.pieces(sources[n], params[n].shape)}
    found = {(hf, index) for hf, (_, index) in plan.items()}
    problems += [f"missing tensor {hf}" for hf, _ in sorted(needed.keys() - found)]
    if problems:
        raise CheckpointError(f"checkpoint {str(path)!r} does not fit the model: " + "; ".join(problems))
    for name in zero_fill:
        params[name].zero_()
    for hf_name, tensor in iter_hf_tensors(path, names=plan):
        names, index = plan[hf_name]
        for native in names:
            if index is None:
                _load_into(params[native], tensor)
            else:
                _load_piece(params[native], index, tensor)


@torch.no_grad()
def load_adapter(model: nn.Module, tensors: dict[str, torch.Tensor], *, partial: bool = False,
                 source: str = "the adapter") -> None:
    """Fill every LoRA adapter parameter of `model` from whole tensors keyed by PEFT name (each rank
    keeps its slice). Strict: every adapter filled, shapes equal, every tensor used unless
    `partial` (a pipeline stage holds some layers only). CheckpointError listing the problems."""
    mine = {peft: (native, p) for native, peft, p in adapter_parameters(model)}
    problems = []
    for name in tensors:
        parse_peft_name(name)
        if name not in mine and not partial:
            problems.append(f"unexpected tensor {name}")
    for peft, (_, p) in mine.items():
        if peft not in tensors:
            problems.append(f"missing tensor {peft}")
        elif tuple(tensors[peft].shape) != tuple(p.shape):
            problems.append(f"{peft}: shape {tuple(tensors[peft].shape)}, model has {tuple(p.shape)}")
    if problems:
        raise CheckpointError(f"{source} does not fit the model: " + "; ".join(problems))
    for peft, (_, p) in mine.items():
        _load_into(p, tensors[peft])


def load_adapter_dir(model: nn.Module, path: str | os.PathLike[str], *, partial: bool = False) -> None:
    """`load_adapter` from a PEFT adapter directory."""
    load_adapter(model, read_adapter(path), partial=partial, source=f"adapter {str(path)!r}")

"""Loading an HF checkpoint into sharded (DTensor) parameters without a full model anywhere.

Each rank reads each tensor from the safetensors files (memory-mapped, one tensor at a time) and
keeps only its own slice, cut according to the parameter's placements: no communication, and
the same code serves FSDP shards today and tensor-parallel shards later.
"""

from __future__ import annotations

import os

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from tandem.errors import CheckpointError
from tandem.models.hf_checkpoint import iter_hf_tensors, read_tensor_shapes


def _load_into(param: torch.Tensor, full: torch.Tensor) -> None:
    full = full.to(device=param.device, dtype=param.dtype)
    if isinstance(param, DTensor):
        # src_data_rank=None: every rank has the full tensor and slices it locally.
        param.copy_(distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None))
    else:
        param.copy_(full)


@torch.no_grad()
def load_hf_weights_sharded(model: nn.Module, path: str | os.PathLike[str], *, partial: bool = False,
                            aliases: dict[str, str] | None = None) -> None:
    """Strict: every parameter filled, every tensor used (bar ones the adapter skips, such as a
    tied `lm_head`), shapes equal to the parameters' global shapes.

    `partial` (a pipeline stage's model): tensors of parameters the model does not hold are
    skipped. `aliases`: native name -> the native name whose HF tensor fills it too (a pipeline
    stage's own copy of a tied weight, `output.weight` -> `tok_embeddings.weight`)."""
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
        # A piece (index not None) is one row of a stacked parameter (e.g. one MoE expert).
        bad = [n for n in wanted[native] if tuple(params[n].shape[0 if index is None else 1:]) != shape]
        if bad:
            problems.append(f"{hf_name}: shape {shape} in {file.name}, model has {tuple(params[bad[0]].shape)}")
        else:
            plan[hf_name] = (wanted[native], index)
    found = {(hf, index) for hf, (_, index) in plan.items()}
    for n in sorted(params):
        problems += [f"missing tensor {hf}" for hf, index in adapter.pieces(sources[n], params[n].shape)
                     if (hf, index) not in found]
    if problems:
        raise CheckpointError(f"checkpoint {str(path)!r} does not fit the model: " + "; ".join(problems))
    stacked: dict[str, tuple[torch.Tensor, int]] = {}  # native -> (full buffer, pieces still to come)
    for hf_name, tensor in iter_hf_tensors(path, names=plan):
        natives, index = plan[hf_name]
        for native in natives:
            if index is None:
                _load_into(params[native], tensor)
                continue
            buffer, left = stacked.get(native) or (torch.empty(params[native].shape, dtype=tensor.dtype),
                                                   params[native].shape[0])
            buffer[index] = tensor
            stacked[native] = (buffer, left - 1)
            if left == 1:
                _load_into(params[native], stacked.pop(native)[0])

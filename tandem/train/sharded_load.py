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
from tandem.models.state_dict_adapter import piece_shape


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
    pieces = {piece: native for native in wanted for piece in adapter.pieces(native, params[wanted[native][0]].shape)}
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
        if native not in wanted or (hf_name, index) not in pieces:
            if not partial:
                problems.append(f"unexpected tensor {hf_name}")
            continue
        bad = [n for n in wanted[native] if tuple(piece_shape(params[n].shape, index)) != shape]
        if bad:
            expected = tuple(piece_shape(params[bad[0]].shape, index))
            problems.append(f"{hf_name}: shape {shape} in {file.name}, model has {expected}")
        else:
            plan[hf_name] = (wanted[native], index)
    got = {(hf_name, index) for hf_name, (_, index) in plan.items()}
    problems += [f"missing tensor {hf}" for hf, index in sorted(pieces.keys() - got, key=lambda p: p[0])]
    if problems:
        raise CheckpointError(f"checkpoint {str(path)!r} does not fit the model: " + "; ".join(problems))
    # A stacked parameter (several HF pieces) is assembled whole, then distributed like any other.
    left = {n: sum(1 for piece_native in pieces.values() if piece_native == n) for n in wanted}
    stacks: dict[str, torch.Tensor] = {}
    for hf_name, tensor in iter_hf_tensors(path, names=plan):
        natives, index = plan[hf_name]
        source = sources[natives[0]]
        if index is not None:
            stack = stacks.setdefault(source, torch.empty(params[natives[0]].shape, dtype=tensor.dtype))
            stack[index].copy_(tensor)
            left[source] -= 1
            if left[source]:
                continue
            tensor = stacks.pop(source)
        for native in natives:
            _load_into(params[native], tensor)

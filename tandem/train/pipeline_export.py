"""Full HF tensors out of a pipeline-parallel model, in buckets, gathered per stage.

Every rank walks the same buckets (planned from a meta copy of the whole model), each holding
parameters of one pipeline rank only, gathered by that owner's ranks. With `dst` (weight sync,
save) the owner-stage rank in `dst`'s pipeline group sends the bucket to `dst` and every other rank
gets `[]`; without `dst` it is broadcast over the pipeline group. A tied embedding/output weight is
exported once, under the embedding's name; buckets carry HF pieces. See docs/training.md,
"Pipeline parallelism"."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from tandem.models import build_model
from tandem.models.common.lora import add_lora, is_adapter_param, peft_name
from tandem.models.qwen.pipeline import parameter_stage
from tandem.models.state_dict_adapter import Piece, piece_shape
from tandem.parallel.pipeline import PipelineLayout
from tandem.train.weight_export import _destinations, gather_bucket
from tandem.weights.source import Alloc


@dataclass(frozen=True)
class ExportEntry:
    native: str
    pieces: tuple[Piece, ...]  # its HF tensors, `(hf_name, index along dim 0 | None)`
    shape: torch.Size  # of the whole parameter
    dtype: torch.dtype
    owner: int  # pipeline rank holding the parameter
    adapter: bool = False  # a LoRA adapter parameter (`pieces` hold its PEFT name)

    @property
    def hf_names(self) -> list[str]:
        return [hf for hf, _ in self.pieces]

    @property
    def piece_shapes(self) -> list[torch.Size]:
        return [piece_shape(self.shape, index) for _, index in self.pieces]


def export_plan(model: nn.Module, layout: PipelineLayout) -> list[ExportEntry]:
    """Every parameter of the whole model in export order (that of an unsplit model's
    `named_parameters`, tied weights once), with its owning pipeline rank; LoRA adapters (when
    `model` has them) under their PEFT names, with `adapter` set."""
    full = build_model(model.hf_config, dtype=torch.float32, device="meta")
    if getattr(model, "lora_config", None) is not None:
        add_lora(full, model.lora_config)
    adapter = model.spec.state_dict_adapter_cls(model.args)
    return [ExportEntry(name, ((peft_name(adapter, name), None),) if is_adapter_param(name)
                        else tuple(adapter.pieces(name, p.shape)), p.shape, p.dtype,
                        layout.stage_rank(parameter_stage(name, layout)), is_adapter_param(name))
            for name, p in full.named_parameters()]


def exported(plan: list[ExportEntry], adapter_only: bool) -> list[ExportEntry]:
    """What an export of `plan` carries: the adapters alone, or the rest. Merged weights (a model
    with adapters, exported whole) are not implemented under pipeline parallelism."""
    if not adapter_only and any(e.adapter for e in plan):
        raise NotImplementedError("exporting merged LoRA weights under pipeline parallelism is not implemented; "
                                  "use servers that take adapters (tandem serve) or a layout without pp")
    return [e for e in plan if e.adapter == adapter_only]


def _buckets(plan: list[ExportEntry], bucket_bytes: int, dtype: torch.dtype | None) -> list[list[ExportEntry]]:
    out: list[list[ExportEntry]] = []
    size = 0
    for e in plan:
        nbytes = e.shape.numel() * (dtype or e.dtype).itemsize
        if not out or e.owner != out[-1][0].owner or (out[-1] and size + nbytes > bucket_bytes):
            out.append([])
            size = 0
        out[-1].append(e)
        size += nbytes
    return out


def _receive_buffers(alloc: Alloc | None, names: list[str], shapes: list[torch.Size], dtype: torch.dtype,
                     device: torch.device) -> list[torch.Tensor]:
    """Where a bucket another rank sends arrives: the caller's tensors (`alloc`), or new ones."""
    return _destinations(alloc, names, shapes, dtype, device) or [torch.empty(s, dtype=dtype, device=device)
                                                                 for s in shapes]


def _peer_of(mesh: DeviceMesh, rank: int, pp_rank: int) -> int:
    """The global rank at pipeline position `pp_rank` in global `rank`'s pipeline group."""
    ranks = mesh.mesh
    coords = (ranks == rank).nonzero()[0].tolist()
    coords[mesh.mesh_dim_names.index("pp")] = pp_rank
    return int(ranks[tuple(coords)])


@torch.no_grad()
def iter_pipeline_buckets(model: nn.Module, plan: list[ExportEntry], mesh: DeviceMesh, bucket_bytes: int,
                          dtype: torch.dtype | None = None, alloc: Alloc | None = None, dst: int | None = None,
                          ) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Buckets of `(hf_name, full tensor)` (see the module docstring; the contract of
    `weight_export.iter_weight_buckets`). Collective: iterate it fully, on every rank."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    params = dict(model.named_parameters())
    me = dist.get_rank()
    pp_mesh = mesh["pp"]
    my_pp = pp_mesh.get_local_rank()
    group = pp_mesh.get_group()
    device = next(iter(params.values())).device
    scratch: dict[str, torch.Tensor] = {}
    for bucket in _buckets(plan, bucket_bytes, dtype):
        owner = bucket[0].owner
        names = [hf for e in bucket for hf in e.hf_names]
        shapes = [s for e in bucket for s in e.piece_shapes]
        out_dtype = dtype or bucket[0].dtype
        mine = [(e.pieces, params[e.native]) for e in bucket] if my_pp == owner else None
        if dst is None:
            if mine is not None:
                got = gather_bucket(mine, dtype, scratch, alloc, None)
                tensors = [t for _, t in got]
            else:
                tensors = _receive_buffers(alloc, names, shapes, out_dtype, device)
            for t in tensors:
                dist.broadcast(t, src=dist.get_global_rank(group, owner), group=group)
            yield list(zip(names, tensors, strict=True))
            continue
        sender = _peer_of(mesh, dst, owner)
        if mine is not None:
            got = gather_bucket(mine, dtype, scratch, alloc if me == dst else None, dst=sender)
            if me == sender and sender != dst:
                for _, t in got:
                    dist.send(t.contiguous(), dst=dst)
                got = []
            yield got
        elif me == dst:
            tensors = _receive_buffers(alloc, names, shapes, out_dtype, device)
            for t in tensors:
                dist.recv(t, src=sender)
            yield list(zip(names, tensors, strict=True))
        else:
            yield []


def plan_nbytes(plan: list[ExportEntry], dtype: torch.dtype | None, align: int = 64) -> int:
    """Bytes of an export in `dtype`, each HF tensor rounded up to `align` bytes (as `export_nbytes`)."""
    return sum(-(-s.numel() * (dtype or e.dtype).itemsize // align) * align for e in plan for s in e.piece_shapes)

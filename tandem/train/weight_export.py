"""Full HF-named tensors out of a (sharded) model, one at a time or in byte-bounded buckets.

Gathering is a collective: order (`named_parameters()`) and bucket boundaries (shapes, dtypes) are
the same on every rank, so every rank must iterate an export fully. Tied weights appear once (under
the embedding's HF name). A bucket of FSDP / HSDP shards travels in one collective
(`gather_bucket`); other placements fall back to `full_tensor()` per parameter. A parameter is
gathered whole, once, and yields one `(hf_name, tensor)` per HF piece (views, or with `alloc` the
caller's buffers); sizes, names, `local_parameters` and `export_nbytes` count HF pieces. Figures
and details: docs/training.md, "Weight export"."""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from tandem.models.common.lora import adapter_parameters, base_of_adapters, is_adapter_param, merged_weight
from tandem.models.state_dict_adapter import Piece, piece_shape
from tandem.weights.source import Alloc


def hf_parameter_names(model: nn.Module, adapter_only: bool = False) -> list[tuple[str, list[Piece], nn.Parameter]]:
    """(native name, its HF pieces `[(hf_name, index | None)]`, parameter) in export order (that of
    `named_parameters()`; tied weights once). Pieces are in file order; `index` is the position
    along dim 0 of the (global) parameter, None for a parameter that is one HF tensor. LoRA
    adapters (`tandem.models.common.lora`) are left out, or with `adapter_only` are all there is,
    under their PEFT names."""
    if adapter_only:
        return [(name, [(peft, None)], p) for name, peft, p in adapter_parameters(model)]
    adapter = model.spec.state_dict_adapter_cls(model.args)
    return [(name, adapter.pieces(name, p.shape), p) for name, p in model.named_parameters()
            if not is_adapter_param(name)]


def split_pieces(pieces: Sequence[Piece], full: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """`(hf_name, tensor)` per piece of a whole parameter `full`: views, nothing copied."""
    return [(hf_name, full if index is None else full[index]) for hf_name, index in pieces]


def _as_pieces(name: str | Sequence[Piece]) -> list[Piece]:
    return [(name, None)] if isinstance(name, str) else list(name)


def _nbytes(param: torch.Tensor, dtype: torch.dtype | None) -> int:
    element = torch.empty((), dtype=dtype or param.dtype).element_size()
    return param.numel() * element  # numel of a DTensor is its global numel


@torch.no_grad()
def full_tensor(param: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The whole tensor on this rank (a collective for DTensors), cast to `dtype` when given.
    Casting happens on the local shard, before the gather, so bf16 export moves half the bytes."""
    t = param.detach()
    if dtype is not None:
        t = t.to(dtype)
    return t.full_tensor() if isinstance(t, DTensor) else t


SAVE_BUCKET_BYTES = 128 << 20  # gathered together when saving; bounds the memory a save adds


def iter_hf_tensors_from_model(
    model: nn.Module, dtype: torch.dtype | None = None, bucket_bytes: int = SAVE_BUCKET_BYTES,
    dst: int | None = None, adapter_only: bool = False,
) -> Iterator[tuple[str, torch.Tensor]]:
    """`(hf_name, full tensor)` one HF tensor at a time, gathered a bucket at a time (one
    collective per bucket, see `gather_bucket`); with `dst`, only on that rank (nothing elsewhere).
    Collective: consume it on every rank."""
    for bucket in iter_weight_buckets(model, bucket_bytes, dtype, dst=dst, adapter_only=adapter_only):
        yield from bucket


def _adapters_by_weight(model: nn.Module, dst: int | None) -> dict[int, tuple[torch.Tensor, torch.Tensor, float]]:
    """id(adapted weight parameter) -> (whole `a`, whole `b`, scale), float32, on `dst` (every
    rank without one; `{}` elsewhere). Collective."""
    params = dict(model.named_parameters())
    out = {}
    for a_name, base in base_of_adapters(model).items():
        b_name = a_name[: -len(".a.weight")] + ".b.weight"
        a, b = full_tensor(params[a_name], torch.float32), full_tensor(params[b_name], torch.float32)
        scale = model.get_submodule(a_name[: -len(".a.weight")]).scale
        if dst is None or _global_rank() == dst:
            out[id(params[base])] = (a, b, scale)
    return out


def iter_weight_buckets(
    model: nn.Module, bucket_bytes: int, dtype: torch.dtype | None = None, alloc: Alloc | None = None,
    dst: int | None = None, adapter_only: bool = False,
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Buckets of `(hf_name, full tensor)` of at most `bucket_bytes` each, cut between parameters
    (a parameter's pieces travel in one bucket); a single parameter larger than the limit travels
    alone. A bucket is gathered only when asked for and is not referenced
    after the next one is requested, so at most one bucket is materialised at a time (as long as
    the caller drops it too). `alloc` (see `Alloc`) lets the caller say where each bucket's
    tensors are written, e.g. straight into a send buffer. `dst` (a global rank): only that rank
    needs the tensors; every other rank gets an empty list per bucket, and FSDP shards travel to
    `dst` alone instead of to every rank. A model with LoRA adapters exports its merged weights
    (`W + scale * B A` per adapted weight), or with `adapter_only` its adapters alone (PEFT names).
    Collective: iterate it fully, on every rank."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    merge = {} if adapter_only else _adapters_by_weight(model, dst)
    plan: list[list[tuple[list[Piece], nn.Parameter]]] = [[]]
    size = 0
    for _, pieces, param in hf_parameter_names(model, adapter_only):
        nbytes = _nbytes(param, dtype)
        if plan[-1] and size + nbytes > bucket_bytes:
            plan.append([])
            size = 0
        plan[-1].append((pieces, param))
        size += nbytes
    scratch: dict[str, torch.Tensor] = {}  # the gather buffer, reused by every bucket of this export
    for entries in plan:
        if not entries:
            continue
        bucket = gather_bucket(entries, dtype, scratch, alloc, dst)
        if merge and bucket:
            owners = [param for pieces, param in entries for _ in pieces]  # the parameter of each piece
            for i, (param, (name, t)) in enumerate(zip(owners, bucket, strict=True)):
                if id(param) in merge:
                    merged = merged_weight(t, *merge[id(param)])
                    if alloc is not None:
                        t.copy_(merged)  # the caller's buffer
                    else:  # `t` may be the parameter itself (a plain model exports views)
                        bucket[i] = (name, merged)
        yield bucket


def _dim0_shard_axis(t: torch.Tensor) -> int | None:
    """The mesh dimension along which DTensor `t` is sharded on dim 0, when it is replicated along
    every other one (FSDP, HSDP); None for anything else (plain tensors, TP, partial values)."""
    if not isinstance(t, DTensor) or t.dim() == 0:
        return None
    axes = [i for i, p in enumerate(t.placements) if not p.is_replicate()]
    if len(axes) != 1 or type(t.placements[axes[0]]) is not Shard or t.placements[axes[0]].dim != 0:
        return None
    return axes[0]


@torch.no_grad()
def gather_bucket(entries: Sequence[tuple[str | Sequence[Piece], torch.Tensor]], dtype: torch.dtype | None = None,
                  scratch: dict[str, torch.Tensor] | None = None, alloc: Alloc | None = None,
                  dst: int | None = None) -> list[tuple[str, torch.Tensor]]:
    """`(hf_name, full tensor)` per HF piece for one bucket of `(pieces, parameter)` (a plain HF
    name stands for one whole piece), cast to `dtype` when given. Collective. Parameters sharded
    on dim 0 over the same mesh dimension travel in one all-gather, each padded to DTensor's own
    `ceil(rows / world)`-row slot in one flat buffer;
    anything else is gathered one parameter at a time (`full_tensor()`). `scratch` keeps the
    gather buffer for the next bucket (fresh pages cost more than the copies); the tensors returned
    never alias it. Without `alloc`, the pieces of a parameter are views of its gathered tensor;
    with `alloc`, they are the tensors it gave (one per piece, written in place). With `dst`, ranks
    other than `dst` get `[]` (and send their shards to `dst` only)."""
    params = [p.detach() for _, p in entries]
    pieces = [_as_pieces(name) for name, _ in entries]
    names = [hf for ps in pieces for hf, _ in ps]
    shapes = [piece_shape(p.shape, index) for ps, p in zip(pieces, params, strict=True) for _, index in ps]
    axes = {_dim0_shard_axis(p) for p in params}
    first = params[0]
    # Decided by placements, meshes and dtypes only, so every rank takes the same branch.
    fused = (len(axes) == 1 and None not in axes and len({(p.device_mesh, p.placements) for p in params}) == 1
             and len({dtype or p.dtype for p in params}) == 1)
    if not fused:
        fulls = [full_tensor(p, dtype) for p in params]
        if dst is not None and _global_rank() != dst:
            return []
        out = [piece for ps, full in zip(pieces, fulls, strict=True) for piece in split_pieces(ps, full)]
        dests = _destinations(alloc, names, shapes, fulls[0].dtype, fulls[0].device)
        if dests is None:
            return out
        for dest, (_, t) in zip(dests, out, strict=True):
            dest.copy_(t)
        return list(zip(names, dests, strict=True))
    axis = axes.pop()
    mesh = first.device_mesh
    world, rank = mesh.size(axis), mesh.get_local_rank(axis)
    out_dtype = dtype or first.dtype
    slots = []  # per parameter: (offset in a rank's slot, rows per rank, elements per row)
    offset = 0
    for p in params:
        rows, row_numel = -(-p.shape[0] // world), math.prod(p.shape[1:])
        slots.append((offset, rows, row_numel))
        offset += rows * row_numel
    device = first.to_local().device
    group = mesh.get_group(axis)
    members = dist.get_process_group_ranks(group)
    if dst is not None and dst not in members:
        return []  # another replica (HSDP) brings the shards to `dst`
    grid = _scratch(scratch, world * offset, out_dtype, device).view(world, offset)
    for p, (off, rows, _) in zip(params, slots, strict=True):  # this rank's slot: its shards, cast
        shard = p.to_local()
        expected = _rows_of(rank, rows, p.shape[0])
        if shard.shape[0] != expected:  # not DTensor's ceil-chunk sharding: a bug to report, not to mask
            raise RuntimeError(f"shard of {tuple(p.shape)} on rank {rank} of {world} has {shard.shape[0]} rows, "
                               f"expected {expected}")
        grid[rank, off: off + shard.numel()].view(shard.shape).copy_(shard)
    if dst is None:
        all_gather_flat(grid, rank, group)
    else:
        gather_flat(grid, rank, members.index(dst), group)
        if _global_rank() != dst:
            return []
    dests = _destinations(alloc, names, shapes, out_dtype, device)
    out: list[tuple[str, torch.Tensor]] = []
    for ps, p, (off, rows, row_numel) in zip(pieces, params, slots, strict=True):
        if dests is None:
            full = torch.empty(p.shape, dtype=out_dtype, device=device)
            _copy_rows(full.view(-1), grid, off, rows, row_numel, 0, p.shape[0])
            out.extend(split_pieces(ps, full))
            continue
        for hf_name, index in ps:  # straight from the gather into each piece's destination
            dest = dests[len(out)]
            start, end = (0, p.shape[0]) if index is None else (index, index + 1)
            _copy_rows(dest.view(-1), grid, off, rows, row_numel, start, end)
            out.append((hf_name, dest))
    return out


def _copy_rows(flat: torch.Tensor, grid: torch.Tensor, off: int, rows: int, row_numel: int, start: int,
               end: int) -> None:
    """Rows [start, end) of a parameter out of the gathered `grid` into `flat` (their elements, in
    order): rank r holds rows [r * rows, (r + 1) * rows) at offset `off` of its slot (fewer or none
    at the end: ceil chunks)."""
    if rows == 0:
        return
    for r in range(start // rows, -(-end // rows)):
        lo, hi = max(start, r * rows), min(end, (r + 1) * rows)
        if hi > lo:
            src = off + (lo - r * rows) * row_numel
            flat[(lo - start) * row_numel: (hi - start) * row_numel].copy_(grid[r, src: src + (hi - lo) * row_numel])


def _rows_of(rank: int, rows: int, total: int) -> int:
    """Rows of a `total`-row tensor that `rank` holds when each holds `rows` (ceil chunks)."""
    return max(0, min(rows, total - rank * rows))


def _destinations(alloc: Alloc | None, names: list[str], shapes: list[torch.Size], dtype: torch.dtype,
                  device: torch.device) -> list[torch.Tensor] | None:
    """The caller's tensors for this bucket, one per HF tensor (checked: a wrong one would corrupt
    the export), or None."""
    dests = None if alloc is None else alloc(names, list(shapes), dtype, device)
    if dests is not None:
        bad = [n for n, d, s in zip(names, dests, shapes, strict=False)
               if d.shape != s or d.dtype != dtype or d.device != device or not d.is_contiguous()]
        if len(dests) != len(names) or bad:
            raise ValueError(f"alloc gave tensors that do not fit the bucket (first misfit: {bad[:1]}); it must "
                             "return one contiguous tensor per name with the given shape, dtype and device")
    return dests


def _scratch(scratch: dict[str, torch.Tensor] | None, numel: int, dtype: torch.dtype,
             device: torch.device) -> torch.Tensor:
    buf = scratch.get("gather") if scratch is not None else None
    if buf is None or buf.numel() < numel or buf.dtype != dtype or buf.device != device:
        if scratch is not None:
            scratch.pop("gather", None)  # free the smaller one first
        buf = torch.empty(numel, dtype=dtype, device=device)
        if scratch is not None:
            scratch["gather"] = buf
    return buf[:numel]


def all_gather_flat(grid: torch.Tensor, rank: int, group: dist.ProcessGroup) -> None:
    """Every rank r of `group` gets every other rank's `grid[r]` (in place; `rank` is this one's
    index in the group, its row already filled).
    On gloo as one broadcast per rank: gloo's allgather moves large buffers far slower than its
    broadcast (2 ranks on loopback, 24 MiB each: 45 ms against 14 ms for two broadcasts, 6 MiB:
    6.9 against 4.0 ms). Elsewhere (NCCL) the backend's own all-gather."""
    if dist.get_backend(group) != "gloo":
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        gather(grid.view(-1), grid[rank], group=group)  # in place: the input is the output's row
        return
    for r in range(grid.shape[0]):
        dist.broadcast(grid[r], src=dist.get_global_rank(group, r), group=group)


def gather_flat(grid: torch.Tensor, rank: int, dst: int, group: dist.ProcessGroup) -> None:
    """Rank `dst` of `group` gets every rank's `grid[r]` (in place; `rank` is this one's index in
    the group, its row already filled). On gloo as point-to-point sends straight into the rows,
    elsewhere the backend's gather."""
    if dist.get_backend(group) != "gloo":
        rows = list(grid.unbind(0)) if rank == dst else None
        dist.gather(grid[rank], gather_list=rows, dst=dist.get_global_rank(group, dst), group=group)
        return
    if rank != dst:
        dist.send(grid[rank], dst=dist.get_global_rank(group, dst), group=group)
        return
    works = [dist.irecv(grid[r], src=dist.get_global_rank(group, r), group=group)
             for r in range(grid.shape[0]) if r != dst]
    for work in works:
        work.wait()


def _global_rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def local_parameters(model: nn.Module, adapter_only: bool = False) -> list[list[tuple[str, torch.Tensor]]] | None:
    """Per parameter in export order, its `(hf_name, tensor)` pieces (views of the whole
    parameter, detached and uncast), when this process holds every parameter whole (plain tensors,
    or DTensors over a mesh of one); None otherwise. Grouped by parameter so that a caller cuts
    buckets where the export does (`tandem.weights.packing.plan_buckets`). A model with adapters:
    its adapters with `adapter_only`, else None (its weights are merged, not held)."""
    if not adapter_only and base_of_adapters(model):
        return None
    out = []
    with torch.no_grad():  # to_local is then the shard itself, not an autograd op
        for _, pieces, param in hf_parameter_names(model, adapter_only):
            t = param
            if isinstance(t, DTensor):
                if t.device_mesh.size() != 1:
                    return None
                t = t.to_local()
                if t.shape != param.shape:
                    return None
            # Detach the plain tensor: a DTensor's detach dispatches through DTensor (~12 us a
            # parameter, a few ms an update).
            out.append(split_pieces(pieces, t.detach()))
    return out


def export_nbytes(model: nn.Module, dtype: torch.dtype | None, align: int = 64, adapter_only: bool = False) -> int:
    """Bytes of an export in `dtype` (global shapes), each HF tensor rounded up to `align` bytes."""
    return sum(_aligned(piece_shape(p.shape, index).numel() * (dtype or p.dtype).itemsize, align)
               for _, pieces, p in hf_parameter_names(model, adapter_only) for _, index in pieces)


def _aligned(nbytes: int, align: int) -> int:
    return -(-nbytes // align) * align

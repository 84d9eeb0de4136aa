"""Pipeline parallelism, model-agnostic parts: schedules, the stage layout, packed micro-batches
stacked for `torch.distributed.pipelining`, and the gradient/norm reductions a pipeline needs.

`pp` ranks run `pp * stages_per_rank` stages (`1F1B`: one per rank; looped schedules: stage s on
rank s % pp; the V schedules `ZBVZeroBubble` and `DualPipeV`: rank r holds stages r and 2*pp-1-r). The schedules split inputs on
dim 0, so `stack_packed` pads each packed micro-batch to the longest and stacks them, with the real
counts in `sizes`; a stage computes on the real tokens only (`unpad_row`). See docs/parallelism.md."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from tandem.errors import ConfigError
from tandem.parallel.config import V_SCHEDULES, check_pipeline_options
from tandem.parallel.tensor_parallel import local_tensor

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PipelineLayout:
    """Which stages each pipeline rank runs and which layers each stage holds."""

    schedule: str  # a full name from SCHEDULES
    pp: int
    stages_per_rank: int
    n_layers: int

    @property
    def n_stages(self) -> int:
        return self.pp * self.stages_per_rank

    @property
    def style(self) -> str:
        return "v" if self.schedule in V_SCHEDULES else "loop"

    def stage_rank(self, stage: int) -> int:
        """The pipeline rank (index in the pp group) that runs `stage`."""
        if self.style == "v":
            return stage if stage < self.pp else self.n_stages - 1 - stage
        return stage % self.pp

    def rank_stages(self, pp_rank: int) -> list[int]:
        """Stages of pipeline rank `pp_rank`, ascending."""
        return [s for s in range(self.n_stages) if self.stage_rank(s) == pp_rank]

    def stage_layers(self, stage: int) -> list[int]:
        """Layer indices of `stage`: contiguous, as even as possible, earlier stages one more
        when they do not divide (the last stage also carries the output head)."""
        base, extra = divmod(self.n_layers, self.n_stages)
        start = stage * base + min(stage, extra)
        return list(range(start, start + base + (1 if stage < extra else 0)))

    def layer_stage(self, layer: int) -> int:
        return next(s for s in range(self.n_stages) if layer in self.stage_layers(s))

    def n_microbatches(self, requested: int | None) -> int:
        """At least `requested` and at least one per stage (raised with a warning when lower)."""
        if requested is None:
            return self.n_stages
        if requested < self.n_stages:
            log.warning("actor.parallelize.pp_microbatches=%d is below the %d pipeline stages; using %d",
                        requested, self.n_stages, self.n_stages)
            return self.n_stages
        return requested


def resolve_layout(schedule: str, pp: int, stages_per_rank: int | None, n_layers: int) -> PipelineLayout:
    """Check the pipeline options against `pp` and the model depth; raises `ConfigError` naming the key."""
    name, per_rank = check_pipeline_options(schedule, stages_per_rank)
    layout = PipelineLayout(name, pp, per_rank, n_layers)
    if n_layers < layout.n_stages:
        raise ConfigError(f"the model has {n_layers} layers, fewer than the {layout.n_stages} pipeline stages "
                          f"(pp={pp} x actor.parallelize.pp_stages_per_rank={per_rank}); lower either")
    return layout


def build_schedule(layout: PipelineLayout, stages: Sequence, n_microbatches: int,
                   loss_fn: Callable[..., torch.Tensor] | None):
    """The `torch.distributed.pipelining` schedule over this rank's `stages` (PipelineStage objects,
    in `layout.rank_stages` order). Gradients are not scaled: `loss_fn` returns each micro-batch's
    share of the global loss already."""
    from torch.distributed.pipelining import schedules

    cls = schedules.get_schedule_class(layout.schedule)
    if layout.schedule == "1F1B":
        (stage,) = stages
        return cls(stage, n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=False)
    return cls(list(stages), n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=False)


# ------------------------------------------------------------------------------ micro-batches


@dataclass
class StackedMicroBatches:
    """Packed micro-batches padded and stacked, one row each: `input_ids [M, T]`, `cu_seqlens
    [M, B + 1]` (each row padded by repeating its last entry), `sizes [M, 2]` = (tokens, sequences)
    of each row, `wanted [M, T]` bool or None (where the output head is needed)."""

    input_ids: torch.Tensor
    cu_seqlens: torch.Tensor
    sizes: torch.Tensor
    wanted: torch.Tensor | None

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    @property
    def width(self) -> int:
        return self.input_ids.shape[1]

    def kwargs(self) -> dict[str, torch.Tensor]:
        """What every stage receives (the schedule splits each along dim 0)."""
        out = {"tokens": self.input_ids, "cu_seqlens": self.cu_seqlens, "sizes": self.sizes}
        if self.wanted is not None:
            out["wanted"] = self.wanted
        return out


def stack_packed(input_ids: Sequence[torch.Tensor], cu_seqlens: Sequence[torch.Tensor],
                 wanted: Sequence[torch.Tensor | None] | None = None) -> StackedMicroBatches:
    """Stack packed micro-batches (see `StackedMicroBatches`). `wanted`: per micro-batch a `[T]`
    bool mask or None; when any is given, the Nones become all-true."""
    width = max(int(ids.shape[0]) for ids in input_ids)
    seqs = max(int(cu.shape[0]) for cu in cu_seqlens)
    ids = torch.stack([F.pad(t, (0, width - t.shape[0])) for t in input_ids])
    cus = torch.stack([torch.cat([cu, cu[-1:].expand(seqs - cu.shape[0])]) for cu in cu_seqlens])
    sizes = torch.tensor([[int(t.shape[0]), int(cu.shape[0]) - 1] for t, cu in zip(input_ids, cu_seqlens,
                                                                                strict=True)],
                         dtype=torch.long, device=ids.device)
    masks = None
    if wanted is not None and any(w is not None for w in wanted):
        masks = torch.stack([F.pad(w if w is not None else torch.ones_like(t, dtype=torch.bool),
                                   (0, width - t.shape[0]))
                             for t, w in zip(input_ids, wanted, strict=True)])
    return StackedMicroBatches(ids, cus, sizes, masks)


def unpad_row(sizes: torch.Tensor, cu_seqlens: torch.Tensor, *rows: torch.Tensor | None
              ) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
    """Inside a stage: the real `cu_seqlens` of a one-row chunk (`[1, 2]` sizes, `[1, B+1]`
    cu_seqlens) and each of `rows` (`[1, T, ...]`) cut to the real tokens (`[n, ...]`)."""
    n, b = (int(v) for v in sizes[0].tolist())
    return cu_seqlens[0, : b + 1], [None if r is None else r[0, :n] for r in rows]


def pad_row(x: torch.Tensor, width: int) -> torch.Tensor:
    """`[n, ...]` -> `[1, width, ...]` with zeros after the real tokens."""
    pad = [0, 0] * (x.dim() - 1) + [0, width - x.shape[0]]
    return F.pad(x[None], pad)  # not a view: FSDP hooks the stage's output for backward


# ------------------------------------------------------------------------- reductions


def tied_weight_groups(mesh_ranks: torch.Tensor, pp_dim: int, first: int, last: int):
    """The process group joining pipeline ranks `first` and `last` in this rank's pp group (the
    holders of a tied weight), or None when they are one rank. `mesh_ranks` is the device mesh's
    rank tensor and `pp_dim` its pp dimension. Collective over all ranks (creates one group per
    pp group, in the same order everywhere)."""
    columns = mesh_ranks.movedim(pp_dim, 0).reshape(mesh_ranks.shape[pp_dim], -1)
    mine = None
    me = dist.get_rank()
    for j in range(columns.shape[1]):
        ranks = sorted({int(columns[first, j]), int(columns[last, j])})
        if len(ranks) < 2:
            continue
        group = dist.new_group(ranks)
        if me in ranks:
            mine = group
    return mine


@torch.no_grad()
def sum_tied_grads(copies: Sequence[nn.Parameter], group: dist.ProcessGroup | None) -> None:
    """Make every copy of a tied weight hold the SUM of all copies' gradients (Megatron's
    embedding all-reduce): this rank's copies (`copies`, 0-2) are summed, then all-reduced over
    `group` (the other holder, or None when this rank holds every copy). Copies are sharded
    alike (same shape, same mesh layout), so their local shards line up."""
    if not copies:
        return
    grads = [p.grad for p in copies]
    if any(g is None for g in grads):
        raise RuntimeError("a tied weight copy has no gradient after backward")
    total = local_tensor(grads[0]).clone()
    for g in grads[1:]:
        total += local_tensor(g)
    if group is not None:
        dist.all_reduce(total, group=group)
    for g in grads:
        local_tensor(g).copy_(total)


def all_reduce_norm(local_norm: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """L2 norm over the pipeline: each rank's norm of its own stages' gradients combined."""
    if group is None:
        return local_norm
    sq = local_norm.double() ** 2
    dist.all_reduce(sq, group=group)
    return sq.sqrt().to(local_norm.dtype)


@torch.no_grad()
def forward_only(layout: PipelineLayout, modules: Sequence[nn.Module], stage_ids: Sequence[int],
                 stacked: StackedMicroBatches, hidden_shape: tuple[int, ...], hidden_dtype: torch.dtype,
                 group: dist.ProcessGroup) -> list:
    """Run every micro-batch through the pipeline without gradients; returns the last stage's
    outputs per micro-batch on its rank (`[]` elsewhere). Collective over the pp group.

    The schedules' forward-only mode does not cover every schedule (ZBV plans its backward
    actions regardless), so this is a plain GPipe forward: each rank runs its stages in ascending
    order, every micro-batch per stage, receiving from the previous stage's rank and sending to the
    next one's (tagged by stage, asynchronous sends), which keeps the ranks busy once filled."""
    local = dict(zip(stage_ids, modules, strict=True))
    me = dist.get_rank(group)
    held: dict[int, torch.Tensor] = {}  # micro-batch -> output of the previous local stage
    sends: list = []
    outputs: list = []
    device = stacked.input_ids.device
    for stage in stage_ids:
        module = local[stage]
        prev_local = stage > 0 and layout.stage_rank(stage - 1) == me
        next_rank = layout.stage_rank(stage + 1) if stage + 1 < layout.n_stages else None
        results: dict[int, torch.Tensor] = {}
        for i in range(len(stacked)):
            row = {k: v[i: i + 1] for k, v in stacked.kwargs().items()}
            if stage == 0:
                x = stacked.input_ids[i: i + 1]
            elif prev_local:
                x = held[i]
            else:
                x = torch.empty(hidden_shape, dtype=hidden_dtype, device=device)
                dist.recv(x, src=dist.get_global_rank(group, layout.stage_rank(stage - 1)), group=group, tag=stage)
            out = module(x, **row)
            if next_rank is None:
                outputs.append(out)
            elif next_rank == me:
                results[i] = out
            else:
                sends.append(dist.isend(out.contiguous(), dst=dist.get_global_rank(group, next_rank), group=group,
                                        tag=stage + 1))
        held = results
    for work in sends:
        work.wait()
    return outputs

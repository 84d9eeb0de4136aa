"""The training engine under pipeline parallelism: forward/backward and forward-only over the
pipeline stages of this rank, and the gradient housekeeping before an optimizer step.

Every engine micro-batch is one pipeline micro-batch (padded and stacked by
`tandem.parallel.pipeline.stack_packed`); its loss is the engine's `loss_fn` on its next-token
view divided by the global denominator, as in `TrainEngine.forward_backward` (the schedule does not
scale gradients). See docs/training.md, "Pipeline parallelism"."""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import PipelineStage

from tandem.data.batch import MicroBatch
from tandem.models.qwen.pipeline import tied_copies
from tandem.parallel import ParallelDims, ParallelizeConfig, fsdp_units
from tandem.parallel.pipeline import (
    PipelineLayout,
    StackedMicroBatches,
    all_reduce_norm,
    build_schedule,
    forward_only,
    resolve_layout,
    stack_packed,
    sum_tied_grads,
    tied_weight_groups,
)
from tandem.train.config import MicroBatchConfig
from tandem.train.logprobs import head_outputs, next_token_labels, next_token_outputs
from tandem.train.losses import LossFn
from tandem.train.optim import clip_grads, grads_by_layout, total_grad_norm
from tandem.train.pipeline_export import export_plan, exported, iter_pipeline_buckets, plan_nbytes


def _lcm(a: int, b: int) -> int:
    import math

    return a * b // math.gcd(a, b)


@dataclass
class PipelineRunner:
    """This rank's share of the pipeline: `stages` (the model's stage modules, ascending), the
    pp group and this rank's index in it, and the group joining the tied weight's holders."""

    model: nn.Module
    layout: PipelineLayout
    stages: list[nn.Module]
    group: dist.ProcessGroup
    pp_rank: int
    device: torch.device
    act_dtype: torch.dtype
    tied_group: dist.ProcessGroup | None
    pp_microbatches: int | None = None
    export_plan: list | None = None

    @classmethod
    def build(cls, model: nn.Module, dims: ParallelDims, mesh: DeviceMesh, config: ParallelizeConfig,
              device: torch.device, param_dtype: torch.dtype, reduce_dtype: torch.dtype = torch.float32,
              chunk_size: int = 1024) -> PipelineRunner:
        """Split `model` (meta, in place) into this rank's stages and parallelise them (the model
        family's `parallelize` with `stages`: model-wide steps on the rank's model, FSDP per stage).
        Collective."""
        split = model.spec.pipeline_split
        if split is None:
            raise NotImplementedError(f"model family {model.spec.name!r} has no pipeline split (pp must be 1)")
        config.check_pipeline("actor.parallelize.")
        pp_mesh = mesh["pp"]
        layout = resolve_layout(config.pp_schedule, pp_mesh.size(), config.pp_stages_per_rank, model.args.n_layers)
        pp_rank = pp_mesh.get_local_rank()

        def head(output, hidden, ids, cu, temperature, wanted, tp=None, split=None):
            if split is None:
                return next_token_outputs(output, hidden, ids, cu, temperature, wanted, chunk_size, tp)
            # Context parallel: this rank's slice of the labels, the whole stream's outputs gathered
            # (every CP rank then computes the same loss: `ContextSplit.gather`'s contract).
            labels, valid = next_token_labels(ids, cu)
            if wanted is not None:
                valid = valid & wanted
            outputs = head_outputs(output, hidden, split.local(labels), split.local(valid, False), temperature,
                                   wanted is not None, chunk_size, tp)
            return tuple(split.gather(x) for x in outputs)

        cp_mesh = dims.cp_mesh(mesh)
        stages = split(model, layout, pp_rank, head, cp_mesh.get_group() if cp_mesh is not None else None)
        model.spec.parallelize(model, dims, mesh=mesh, config=config, param_dtype=param_dtype,
                               reduce_dtype=reduce_dtype, stages=stages)
        tied = None
        if model.args.tie_word_embeddings:
            tied = tied_weight_groups(mesh.mesh, mesh.mesh_dim_names.index("pp"),
                                      layout.stage_rank(0), layout.stage_rank(layout.n_stages - 1))
        return cls(model, layout, stages, pp_mesh.get_group(), pp_rank, device, param_dtype, tied,
                   config.pp_microbatches)

    # ------------------------------------------------------------------------- setup

    def fsdp_units(self) -> list:
        return [u for stage in self.stages for u in fsdp_units(stage)]

    def mb_config(self, base: MicroBatchConfig) -> MicroBatchConfig:
        """`base` with at least one micro-batch per stage (and `pp_microbatches`), in a multiple
        of the pipeline depth (the interleaved schedules run whole rounds)."""
        n = max(base.n_mbs, self.layout.n_microbatches(self.pp_microbatches))
        return replace(base, n_mbs=n, n_mbs_divisor=_lcm(base.n_mbs_divisor, self.layout.pp))

    def load_aliases(self) -> dict[str, str]:
        """For `load_hf_weights_sharded`: the output head's own copy of a tied embedding."""
        return {"output.weight": "tok_embeddings.weight"} if self.model.args.tie_word_embeddings else {}

    @property
    def has_first(self) -> bool:
        return any(s.is_first for s in self.stages)

    @property
    def has_last(self) -> bool:
        return any(s.is_last for s in self.stages)

    def from_last_stage(self, values: dict[str, float]) -> dict[str, float]:
        """The last stage's `values` on every rank of the pp group (what only the loss records,
        e.g. a policy loss's stats, is empty on the other stages). Collective over the pp group."""
        box: list[dict[str, float] | None] = [values if self.has_last else None]
        dist.broadcast_object_list(box, src=self._last_rank(), group=self.group)
        return dict(box[0] or {})

    def _last_rank(self) -> int:
        """Global rank of the last stage's rank in this pp group."""
        return dist.get_global_rank(self.group, self.layout.stage_rank(self.layout.n_stages - 1))

    def _pipeline_stages(self, width: int) -> list[PipelineStage]:
        # Rebuilt per call (cheap, no communication): their buffers are shaped by the padded length.
        # Static shapes (no metadata exchange, no trial forward): activations that need gradients
        # are marked so, which is how the stage knows to receive / send their gradients.
        meta = torch.device("meta")
        rows = self.stages[0].local_rows(width)  # under TP: this rank's sequence shard
        hidden = torch.empty((1, rows, self.model.args.dim), dtype=self.act_dtype, device=meta, requires_grad=True)
        out = []
        for module in self.stages:
            inputs = torch.empty((1, width), dtype=torch.long, device=meta) if module.is_first else hidden
            lp = torch.empty((1, width), device=meta, requires_grad=True)
            outputs = (lp, lp) if module.is_last else hidden
            out.append(PipelineStage(module, module.stage, self.layout.n_stages, self.device,
                                     input_args=inputs, output_args=outputs, group=self.group))
        return out

    def _run(self, schedule, stacked: StackedMicroBatches, target: torch.Tensor | None):
        args = (stacked.input_ids,) if self.has_first else ()
        extra = {}
        if "return_outputs" in inspect.signature(schedule.step).parameters:
            extra["return_outputs"] = False
        return schedule.step(*args, target=target, **extra, **stacked.kwargs())

    # ------------------------------------------------------------------------- passes

    def forward_backward(self, views: Sequence[MicroBatch], wanted: Sequence[torch.Tensor | None],
                         loss_fn: LossFn, denominator: float, temperature: float) -> float:
        """Accumulate gradients of sum(loss_fn over `views`) / `denominator`; returns the (undivided)
        loss sum on every rank of the pp group. Collective over the pp group."""
        stacked = stack_packed([v.input_ids for v in views], [v.cu_seqlens for v in views], wanted)
        sums: list[torch.Tensor] = []

        def pipeline_loss(output: tuple[torch.Tensor, torch.Tensor], target: torch.Tensor) -> torch.Tensor:
            i = int(target.reshape(-1)[0])  # the schedule's chunk of arange(M): this micro-batch's index
            n = int(stacked.sizes[i, 0])
            logprobs, entropy = output[0][0, :n], output[1][0, :n]
            view = views[i]
            loss = (logprobs.sum() + entropy.sum()) * 0.0 if view.is_padding else loss_fn(logprobs, entropy, view)
            sums.append(loss.detach().double())
            return loss / denominator

        for stage in self.stages:
            stage.train()
            stage.temperature = temperature
        schedule = build_schedule(self.layout, self._pipeline_stages(stacked.width), len(stacked), pipeline_loss)
        self._run(schedule, stacked, torch.arange(len(stacked), device=self.device))
        total = torch.stack(sums).sum() if sums else torch.zeros((), dtype=torch.float64)
        total = total.to(self.device, torch.float64)
        dist.all_reduce(total, group=self.group)  # only the last stage's rank contributes
        return float(total)

    @torch.no_grad()
    def forward(self, mbs: Sequence[MicroBatch], wanted: Sequence[torch.Tensor | None], temperature: float
                ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """`(logprobs [n], entropy [n])` of every micro-batch, on every rank of the pp group (the
        last stage's results broadcast over it). Collective over the pp group."""
        stacked = stack_packed([mb.input_ids for mb in mbs], [mb.cu_seqlens for mb in mbs], wanted)
        for stage in self.stages:
            stage.eval()
            stage.temperature = temperature
        rows = self.stages[0].local_rows(stacked.width)
        outputs = forward_only(self.layout, self.stages, [s.stage for s in self.stages], stacked,
                               (1, rows, self.model.args.dim), self.act_dtype, self.group)
        for unit in self.fsdp_units():  # stages keep their parameters gathered between micro-batches
            unit.reshard()
        both = torch.empty((2, len(stacked), stacked.width), dtype=torch.float32, device=self.device)
        if self.has_last:
            for i, (logprobs, entropy) in enumerate(outputs):
                both[0, i].copy_(logprobs[0])
                both[1, i].copy_(entropy[0])
        dist.broadcast(both, src=self._last_rank(), group=self.group)
        sizes = stacked.sizes[:, 0].tolist()
        return [(both[0, i, :n], both[1, i, :n]) for i, n in enumerate(sizes)]

    # ------------------------------------------------------------------------ export

    def export_buckets(self, mesh: DeviceMesh, bucket_bytes: int, dtype: torch.dtype | None, alloc=None,
                       dst: int | None = None, adapter_only: bool = False):
        """Full HF tensors of the whole model (or its LoRA adapters alone) in buckets (see
        `tandem.train.pipeline_export`). Collective."""
        return iter_pipeline_buckets(self.model, exported(self._plan(), adapter_only), mesh, bucket_bytes, dtype,
                                     alloc, dst)

    def export_nbytes(self, dtype: torch.dtype | None, adapter_only: bool = False) -> int:
        return plan_nbytes([e for e in self._plan() if e.adapter == adapter_only], dtype)

    def num_parameters(self) -> int:
        return sum(e.shape.numel() for e in self._plan())

    def _plan(self):
        if self.export_plan is None:
            self.export_plan = export_plan(self.model, self.layout)
        return self.export_plan

    # ------------------------------------------------------------------- before a step

    def norm_parameters(self) -> list[nn.Parameter]:
        """Parameters whose gradients the global norm counts: a tied weight once (its embedding copy)."""
        skip = {id(self.model.output.weight)} if self.model.args.tie_word_embeddings and self.has_last else set()
        return [p for p in self.model.parameters() if id(p) not in skip]

    def sync_tied(self) -> None:
        """Sum the tied weight's gradient over its copies (first and last stage). Collective."""
        if self.model.args.tie_word_embeddings:
            holders = {self.layout.stage_rank(0), self.layout.stage_rank(self.layout.n_stages - 1)}
            if self.pp_rank in holders:
                sum_tied_grads(tied_copies(self.model), self.tied_group)

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        """Tied gradients summed, then the global L2 norm over every stage and shard; gradients
        scaled down to `max_norm` when it is exceeded (and `max_norm > 0`). Returns the norm."""
        self.sync_tied()
        counted = grads_by_layout(self.norm_parameters())
        local = (total_grad_norm(counted).to(self.device, torch.float32) if counted
                 else torch.zeros((), device=self.device))
        total = all_reduce_norm(local, self.group)
        clip_grads(self.model.parameters(), max_norm, total)
        return total

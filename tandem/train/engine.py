"""`TrainEngine`: a model-agnostic trainer over packed variable-length sequences.

One engine per rank, SPMD: every rank constructs it with the same config and calls the same
methods in the same order (most are collectives). Works in a bare single process too: without a
process group it creates a one-rank group itself.

Construction: build the model on the meta device, parallelise it (the model family's
`ModelSpec.parallelize`: activation checkpointing, compile, FSDP2), allocate only the local
shards (`to_empty`), fill them from the HF checkpoint tensor by tensor, then AdamW + LR schedule.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule

from tandem.config.fields import validate
from tandem.data.balance import sequence_cost
from tandem.data.batch import LOSS_MASK, MicroBatch, SequenceBatch, count_loss_tokens
from tandem.errors import CheckpointError, ConfigError
from tandem.models import build_model, read_hf_config
from tandem.models.common.attention import choose_kernel
from tandem.models.common.lora import add_lora, check_adapter_fits, fresh_adapter, write_adapter
from tandem.models.common.moe import Routing, load_balancing_loss
from tandem.models.hf_checkpoint import DEFAULT_MAX_SHARD_BYTES
from tandem.models.value_head import config_for_head
from tandem.parallel import ParallelDims, fsdp_units
from tandem.parallel.tensor_parallel import sum_partial_grads
from tandem.train import checkpoint as ckpt
from tandem.train.config import TrainEngineConfig, parse_dtype
from tandem.train.dist import all_reduce_sum, init_distributed, resolve_device, seed_everything
from tandem.train.logprobs import LogprobModel, ValueModel
from tandem.train.losses import LossFn, LossWeightFn, ValueLossFn
from tandem.train.microbatch import build_micro_batches, plan_micro_batches, restore_order
from tandem.train.optim import LRSchedule, build_optimizer, clip_grad_norm
from tandem.train.pipeline_step import PipelineRunner
from tandem.train.routed_experts import agreement_of, check_moe_options, routing_for, stack_layers
from tandem.train.sharded_load import load_adapter, load_adapter_dir, load_hf_weights_sharded
from tandem.train.weight_export import (
    SAVE_BUCKET_BYTES,
    export_nbytes,
    iter_weight_buckets,
    local_parameters,
)
from tandem.weights.source import Alloc

logger = logging.getLogger(__name__)

ADAPTER_DIR = "adapter"  # a LoRA engine's PEFT adapter, inside each training-state checkpoint
# Native names of a value model's head: what a critic made from a causal LM starts at zero.
VALUE_HEAD_PARAMS = ("output.weight", "output.bias")


@dataclass
class TokenOutputs:
    """Per-sequence results in batch order: `logprobs[i][t] = log p(token t+1)` of sequence i
    (0 at its last token), `entropy[i][t]` of the same distribution. float32, on CPU.

    MoE models: `routed_experts[i]` (`[L, moe layers, top_k]` int32, input alignment) are the
    experts the forward used, when asked for (`record_experts`); `route_matches` / `route_pairs`
    count this rank's (token, MoE layer) pairs whose live top-k set equals the server's
    (`tandem.train.routed_experts`)."""

    logprobs: list[torch.Tensor]
    entropy: list[torch.Tensor]
    routed_experts: list[torch.Tensor] | None = None
    route_matches: int = 0
    route_pairs: int = 0


EngineHead = Literal["lm", "value"]


class TrainEngine:
    def __init__(self, config: TrainEngineConfig, head: EngineHead = "lm"):
        """Raises `ConfigError` naming the field for a value outside its choices or range.

        `head="value"` builds a value model (a critic, `tandem.models.value_head`): from a value
        model's checkpoint, or from a causal LM's decoder with the value head at zero. Its forward
        gives values (`forward_values`) and `train_batch` takes a `ValueLossFn`. Data and context
        parallel layouts only (the head is neither tensor- nor pipeline-parallel)."""
        validate(config)
        device = torch.device(config.device)
        config.parallelize.check_device(device.type, "parallelize.")
        config.check_attention(device.type)
        # Compile and activation checkpointing left to the device become concrete here.
        parallelize, notes = config.parallelize.for_device(device.type, tp=config.tp, pp=config.pp)
        config = replace(config, parallelize=parallelize)  # the caller's config stays as given
        config.parallelize.check("parallelize.")
        self.config = config
        self._owns_group = init_distributed(device, config.dist_backend)
        self.device = resolve_device(config.device)
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        seed_everything(config.seed, config.deterministic, device.type)
        self.parallel_dims = ParallelDims.for_world(self.world_size, tp=config.tp, pp=config.pp, cp=config.cp,
                                                    ep=config.ep, etp=config.etp, dp_replicate=config.dp_replicate)
        self.mesh = self.parallel_dims.build_mesh(self.device.type)
        self.dp_group = self.parallel_dims.dp_group(self.mesh)
        if self.rank == 0:
            logger.info("parallel dims: %s", self.parallel_dims.describe())

        self.param_dtype = parse_dtype(config.dtype)

        if head == "value" and (config.tp > 1 or config.pp > 1):
            raise ConfigError(f"a critic (value model) runs data or context parallel; tp={config.tp}, "
                              f"pp={config.pp} are not supported for it: give it a layout like archon:d2")
        hf_config, fresh_head = config_for_head(read_hf_config(config.path), head == "value", config.path)
        self.head: EngineHead = head
        # Master weights in float32; FSDP casts them to `param_dtype` for compute.
        self.model = build_model(hf_config, dtype=torch.float32, device="meta")
        self.lora = config.lora if config.lora.enabled else None
        # Weight updates carry the adapters alone (servers merge them into their base), unless the
        # servers take whole weights only: then the merged weights (set False).
        self.sync_adapters = self.lora is not None
        if self.lora is not None:
            if head == "value":
                raise ConfigError("LoRA adapters train a language model; a critic (value model) trains whole: "
                                  "set critic.lora.rank=0")
            self._add_adapters()
        self.model.attention_kernel = choose_kernel(config.attention, device, self.param_dtype, self.model.args.head_dim)
        if self.rank == 0:
            p = config.parallelize
            logger.info("compile=%s, activation_checkpoint=%s%s, attention=%s", p.compile, p.activation_checkpoint,
                        f" ({p.ac_selective})" if p.activation_checkpoint == "selective" else "",
                        self.model.attention_kernel)
            for note in notes:
                logger.info("parallelize: %s", note)
        # Context parallelism lives in the forward: each CP rank runs its slice of every micro-batch.
        cp_mesh = self.parallel_dims.cp_mesh(self.mesh)
        wrapper = ValueModel if head == "value" else LogprobModel
        self.module = wrapper(self.model, chunk_size=config.logprob_chunk_size,
                              cp_group=cp_mesh.get_group() if cp_mesh is not None else None)
        # Pipeline parallelism: this rank's stages of the model (tandem.train.pipeline_step).
        self.pipeline: PipelineRunner | None = None
        if self.parallel_dims.sizes.pp > 1:
            self.pipeline = PipelineRunner.build(self.model, self.parallel_dims, self.mesh, config.parallelize,
                                                 self.device, self.param_dtype, chunk_size=config.logprob_chunk_size)
        n_params = len(list(self.model.parameters()))  # shared parameters count once
        if self.pipeline is None:
            parallelize = self.model.spec.parallelize
            if parallelize is None:
                raise NotImplementedError(f"model family {self.model.spec.name!r} has no parallelize function")
            parallelize(self.model, self.parallel_dims, mesh=self.mesh, config=config.parallelize, root=self.module,
                        param_dtype=self.param_dtype, reduce_dtype=torch.float32)
        # Gradients are SUMMED over DP ranks (not averaged): each rank's loss is already divided
        # by the global loss-token count, so the sum is the gradient of the global token mean.
        for unit in fsdp_units(self.module) if self.pipeline is None else self.pipeline.fsdp_units():
            unit.set_gradient_divide_factor(1.0)
            unit.set_force_sum_reduction_for_comms(True)  # plain SUM (gloo has no PREMUL_SUM)
        self.module.to_empty(device=self.device)
        if not fsdp_units(self.module) and self.pipeline is None:
            self.model.tie_weights()  # a plain module (one rank, float32) came apart in to_empty; FSDP keeps ties
        # Tied weights (e.g. embedding and output head) must still be one parameter.
        if len(list(self.model.parameters())) != n_params:
            raise AssertionError("shared parameters came apart during parallelize / to_empty")
        if self.pipeline is None:
            # A critic made from a causal LM: its decoder's weights, the value head at zero.
            load_hf_weights_sharded(self.model, config.path, zero_fill=VALUE_HEAD_PARAMS if fresh_head else ())
        else:
            load_hf_weights_sharded(self.model, config.path, partial=True, aliases=self.pipeline.load_aliases())
        if self.lora is not None:
            self._load_adapters()
        self._mb_config = config.mb if self.pipeline is None else self.pipeline.mb_config(config.mb)
        self.moe_layers: list[int] = list(getattr(self.model.args, "moe_layers", []))
        check_moe_options(config, self.moe_layers, pipelined=self.pipeline is not None)

        # Frozen parameters (LoRA's base) have no optimizer state.
        self.optimizer = build_optimizer(self.trainable_parameters(), config.optimizer, self.device.type)
        if self.rank == 0:
            trainable = sum(p.numel() for p in self.trainable_parameters())  # global sizes, this rank's stages
            logger.info("trainable parameters: %d of %d (%.2f%%); AdamW state %.2f MB (float32 exp_avg and exp_avg_sq)",
                        trainable, self.num_parameters(), 100 * trainable / max(1, self.num_parameters()),
                        8 * trainable / 1e6)
        self.lr_schedule = LRSchedule.from_config(self.optimizer, config.optimizer, config.total_train_steps)
        self.step = 0

    # ------------------------------------------------------------------------------ adapters

    def _add_adapters(self) -> None:
        """LoRA (`tandem.models.common.lora`): adapters on the targeted linears, float32 (master
        weights, like the whole model's); every other parameter frozen and kept in the compute
        dtype, so it costs no optimizer state and half the memory in bfloat16."""
        adapted = add_lora(self.model, self.lora)
        with torch.no_grad():
            for p in self.model.parameters():
                if not p.requires_grad:
                    p.data = p.data.to(self.param_dtype)  # tied weights are one parameter: cast once
        if self.rank == 0:
            logger.info("LoRA rank %d, alpha %g on %d linear layers (%s)", self.lora.rank, self.lora.alpha,
                        len(adapted), ", ".join(sorted(self.lora.target_modules)))

    def _load_adapters(self) -> None:
        """The adapters' values: from `lora.path` when given (checked against the config), else fresh."""
        partial = self.pipeline is not None
        if self.lora.path:
            check_adapter_fits(self.lora.path, self.lora)
            load_adapter_dir(self.model, self.lora.path, partial=partial)
        else:
            load_adapter(self.model, fresh_adapter(self.model, self.config.seed), partial=partial)

    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        """The parameters the optimizer steps: the adapters under LoRA, else all (this rank's stages'
        under pipeline parallelism)."""
        return [p for p in self.model.parameters() if p.requires_grad]

    # ------------------------------------------------------------------------------ batches

    def _micro_batches(self, batch: SequenceBatch) -> list[MicroBatch]:
        costs = sequence_cost(batch.lengths, self.config.balance, hidden_size=self.model.args.dim)
        plan = plan_micro_batches(batch.lengths, self._mb_config, self.dp_group, self.device, costs)
        return [mb.to(self.device) for mb in build_micro_batches(batch, plan)]

    @torch.no_grad()
    def forward_logprobs(self, batch: SequenceBatch, temperature: float = 1.0,
                         loss_tokens_only: bool = False, record_experts: bool = False,
                         live_routing: bool = False) -> TokenOutputs:
        """Next-token log-probs and entropy of every sequence (see `TokenOutputs`). Collective.
        `loss_tokens_only`: only where the batch's loss mask is set (0 elsewhere), exactly as the
        training forward computes them (same rows through the head, so the same numbers).
        MoE models: experts are replayed as `actor.router_replay` says (`tandem.train.routed_experts`);
        `record_experts` returns the experts every token went through in `TokenOutputs.routed_experts`;
        `live_routing` routes every token live whatever `router_replay` says (the live-routed
        mismatch of `router_replay_live_mismatch`)."""
        if self.head != "lm":
            raise TypeError("forward_logprobs needs a language model; this engine holds a value model "
                            "(forward_values)")
        if record_experts and not self.moe_layers:
            raise ValueError("record_experts needs a mixture-of-experts model; this one has no MoE layers")
        columns, matches, pairs = self._forward_columns(batch, temperature, loss_tokens_only, record_experts,
                                                        live_routing)
        routed = [c[2] for c in columns] if record_experts else None
        return TokenOutputs([c[0] for c in columns], [c[1] for c in columns], routed, matches, pairs)

    @torch.no_grad()
    def forward_values(self, batch: SequenceBatch, loss_tokens_only: bool = False) -> list[torch.Tensor]:
        """A value model's values of every sequence, batch order, float32 on CPU: `values[i][t]`
        is the value of the state after token t (the one token t+1 is generated from; prediction
        alignment, 0 at the last token and, with `loss_tokens_only`, where the loss mask is not
        set). Collective."""
        if self.head != "value":
            raise TypeError("forward_values needs a value model; this engine holds a language model")
        return [c[0] for c in self._forward_columns(batch, 1.0, loss_tokens_only)[0]]

    def _forward_columns(self, batch: SequenceBatch, temperature: float, loss_tokens_only: bool,
                         record_experts: bool = False, live_routing: bool = False) -> tuple[list[tuple[torch.Tensor, ...]], int, int]:
        """No-grad forward of `batch`: per sequence (batch order) the module's outputs on CPU, then
        its routed experts when `record_experts`; and the route matches and pairs of the forward."""
        mbs = self._micro_batches(batch)
        wanted = [self._loss_positions(mb.next_token_view()) if loss_tokens_only else None for mb in mbs]
        routings = [self._routing(mb, record=record_experts, live=live_routing) for mb in mbs]
        if self.pipeline is not None:
            outputs = self.pipeline.forward(mbs, wanted, temperature)
        else:
            self.module.eval()
            outputs = [self.module(mb.input_ids, mb.cu_seqlens, temperature, w, r)
                       for mb, w, r in zip(mbs, wanted, routings, strict=True)]
            if isinstance(self.module, FSDPModule):
                self.module.reshard()  # the root stays gathered after a forward; free it
        per_mb: list[list[tuple[torch.Tensor, ...]]] = []
        matches = pairs = 0
        for mb, output, routing in zip(mbs, outputs, routings, strict=True):
            if mb.is_padding:  # a rank with fewer sequences than micro-batches: nothing to return
                per_mb.append([])
            else:
                columns = [x.cpu().split(mb.lengths) for x in output]
                if record_experts:
                    columns.append(stack_layers(routing.recorded, self.moe_layers).cpu().split(mb.lengths))
                per_mb.append(list(zip(*columns, strict=True)))
            m, n = agreement_of(routing, mb.tokens, self.moe_layers)
            matches, pairs = matches + m, pairs + n
        return restore_order(mbs, per_mb, len(batch)), matches, pairs

    def _routing(self, mb: MicroBatch, record: bool = False, keep_logits: bool = False,
                 live: bool = False) -> Routing | None:
        """The `Routing` of `mb`'s forward (input alignment: `mb`, never its next-token view);
        `live`: replay nothing, whatever `router_replay` says."""
        if self.pipeline is not None or (mb.is_padding and not keep_logits):
            return None
        return routing_for(mb.tokens, "off" if live else self.config.router_replay, self.moe_layers,
                           int(getattr(self.model.args, "num_experts_per_tok", 0)), record=record,
                           keep_logits=keep_logits)

    @staticmethod
    def _loss_positions(view: MicroBatch) -> torch.Tensor | None:
        """`[T]` bool: where a micro-batch (prediction alignment) has loss tokens; None without a mask."""
        return view.tokens[LOSS_MASK] > 0 if LOSS_MASK in view.tokens else None

    def train_batch(
        self,
        batch: SequenceBatch,
        loss_fn: LossFn | ValueLossFn,
        loss_weight_fn: LossWeightFn | None = None,
        temperature: float = 1.0,
    ) -> dict[str, float]:
        """One optimizer step on this rank's share of the global batch. Collective.

        The optimised loss is sum(loss_fn over all micro-batches and DP ranks) /
        sum(loss_weight_fn over the same); see `tandem.train.losses` for the contract.
        Returns loss, grad_norm, lr, n_tokens, n_loss_tokens (global), n_mbs, skipped, time."""
        start = time.perf_counter()
        self.optimizer.zero_grad(set_to_none=True)
        stats = self.forward_backward(batch, loss_fn, loss_weight_fn, temperature)
        stats.update(self.optimizer_step())
        stats["time"] = time.perf_counter() - start
        return stats

    def forward_backward(
        self,
        batch: SequenceBatch,
        loss_fn: LossFn | ValueLossFn,
        loss_weight_fn: LossWeightFn | None = None,
        temperature: float = 1.0,
    ) -> dict[str, float]:
        """Accumulate the gradient of the globally normalised loss (no optimizer step). Collective."""
        weight_fn = loss_weight_fn or count_loss_tokens
        mbs = self._micro_batches(batch)
        views = [mb.next_token_view() for mb in mbs]
        local_weight = sum(float(weight_fn(v)) for v in views if not v.is_padding)
        (total_weight,) = all_reduce_sum([local_weight], self.device, self.dp_group)
        denominator = total_weight if total_weight > 0 else 1.0

        moe = [0.0, 0.0, 0.0]  # weighted aux loss sum, route matches, route pairs
        if self.pipeline is not None:
            wanted = [self._loss_positions(v) for v in views]
            loss_sum = self.pipeline.forward_backward(views, wanted, loss_fn, denominator, temperature)
        else:
            loss_sum = self._forward_backward_local(mbs, views, loss_fn, weight_fn, denominator, temperature, moe)
        total_loss, n_tokens, aux_sum, matches, pairs = all_reduce_sum(
            [float(loss_sum), float(sum(mb.n_tokens for mb in mbs)), *moe], self.device, self.dp_group
        )
        stats = {
            "loss": total_loss / denominator,
            "n_tokens": n_tokens,
            "n_loss_tokens": total_weight,
            "n_mbs": float(len(mbs)),
        }
        if self.config.moe_aux_loss_coef > 0:
            stats["aux_loss"] = aux_sum / denominator
        if pairs:
            stats.update({"route_matches": matches, "route_pairs": pairs})
        return stats

    def _forward_backward_local(self, mbs: list[MicroBatch], views: list[MicroBatch], loss_fn: LossFn | ValueLossFn,
                                weight_fn: LossWeightFn, denominator: float, temperature: float,
                                moe: list[float]) -> float:
        """Forward and backward of every micro-batch; returns the loss sum. MoE: adds
        `moe_aux_loss_coef * load_balancing_loss * (micro-batch weight / denominator)` to the
        optimised loss (so the aux term is a weight-averaged mean over the step's micro-batches)
        and accumulates into `moe` [weighted aux loss, route matches, route pairs]."""
        self.module.train()
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        coef = self.config.moe_aux_loss_coef
        for mb, view in zip(mbs, views, strict=True):
            routing = self._routing(mb, keep_logits=coef > 0)
            # Only loss tokens need the output head (see the loss contract in tandem.train.losses).
            # (log-probs, entropy) of a language model, (values,) of a value model.
            outputs = self.module(view.input_ids, view.cu_seqlens, temperature, self._loss_positions(view), routing)
            if view.is_padding:
                # Runs forward and backward so that FSDP's collectives match the other ranks.
                loss = sum(x.sum() for x in outputs) * 0.0
            else:
                loss = loss_fn(*outputs, view)
            objective = loss
            if coef > 0:
                aux = load_balancing_loss([routing.logits[layer] for layer in self.moe_layers],
                                          int(self.model.args.num_experts_per_tok))
                weight = 0.0 if view.is_padding else float(weight_fn(view))
                objective = loss + coef * weight * aux if weight else loss + aux * 0.0
                moe[0] += weight * float(aux.detach())
            m, n = agreement_of(routing, mb.tokens, self.moe_layers)
            moe[1], moe[2] = moe[1] + m, moe[2] + n
            (objective / denominator).backward()
            loss_sum += loss.detach().double()
        return float(loss_sum)

    def optimizer_step(self) -> dict[str, float]:
        """Clip to the global grad norm, step AdamW (skipped when the norm is not finite) and the
        LR schedule, clear the gradients. Returns grad_norm, lr (the one used), skipped."""
        # Tensor parallelism: plain parameters that each TP rank saw only part of (Qwen3's q/k norms)
        # hold partial gradients until summed over the TP group; nothing may read them before.
        sum_partial_grads(self.model, getattr(self.model, "tensor_parallel", None))
        max_norm = self.config.optimizer.gradient_clipping
        if self.pipeline is not None:
            grad_norm = self.pipeline.clip_grad_norm(max_norm)  # also sums a tied weight's gradient copies
        else:
            grad_norm = clip_grad_norm(self.model.parameters(), max_norm)
        finite = bool(torch.isfinite(grad_norm))
        if finite:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        lr = self.lr_schedule.get_lr()
        self.lr_schedule.step()
        self.step += 1
        return {"grad_norm": float(grad_norm) if finite else math.nan, "lr": lr, "skipped": float(not finite)}

    # -------------------------------------------------------------------- weights and state

    def save_hf(
        self,
        out_dir: str | Path,
        *,
        tokenizer_dir: str | Path | None = None,
        dtype: torch.dtype | None = None,
        max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
        overwrite: bool = False,
    ) -> Path:
        """HF directory of the current weights, in `dtype` (default: the compute dtype); with LoRA
        adapters: the PEFT adapter directory while `sync_adapters` (`save_adapter`), else the
        merged weights. Collective."""
        if self.sync_adapters:
            return self.save_adapter(out_dir, dtype=dtype, overwrite=overwrite)
        dtype = dtype or self.param_dtype
        tensors = None
        if self.pipeline is not None:  # gathered per stage, bucket by bucket, to rank 0
            tensors = (t for b in self.export_weights(SAVE_BUCKET_BYTES, dtype, dst=0) for t in b)
        return ckpt.save_hf_weights(
            self.model,
            out_dir,
            dtype=dtype,
            tokenizer_dir=tokenizer_dir,
            max_shard_bytes=max_shard_bytes,
            overwrite=overwrite,
            tensors=tensors,
        )

    def save_adapter(self, out_dir: str | Path, *, dtype: torch.dtype | None = None, overwrite: bool = False) -> Path:
        """The LoRA adapters as a PEFT directory (`adapter_model.safetensors` + `adapter_config.json`),
        in `dtype` (default float32, as trained). Collective."""
        if self.lora is None:
            raise ValueError("this engine trains no LoRA adapters (actor.lora.rank=0)")
        out = Path(out_dir)
        if out.exists() and (not out.is_dir() or (any(out.iterdir()) and not overwrite)):
            raise CheckpointError(f"{str(out)!r} exists and is not empty; pass overwrite=True or choose another path")
        buckets = self.export_weights(SAVE_BUCKET_BYTES, dtype or torch.float32, dst=0, adapter_only=True)
        tensors = {name: t.clone() for bucket in buckets for name, t in bucket}
        if self.rank == 0:
            write_adapter(out, tensors, self.lora, base_model=self.config.path)
        if self.world_size > 1:
            dist.barrier()
        return out

    def export_weights(self, bucket_bytes: int, dtype: torch.dtype | None = None, alloc: Alloc | None = None,
                       dst: int | None = None, adapter_only: bool | None = None):
        """Buckets of `(hf_name, full tensor)`, at most `bucket_bytes` each, in the compute dtype
        by default, written into `alloc`'s tensors when it gives some, on rank `dst` only when
        given (see `weight_export.iter_weight_buckets`). With LoRA adapters: the adapters alone
        (PEFT names) when `adapter_only` (default: `sync_adapters`), else the merged weights.
        Collective: iterate on every rank."""
        adapter_only = self.sync_adapters if adapter_only is None else adapter_only
        if self.pipeline is not None:
            return self.pipeline.export_buckets(self.mesh, bucket_bytes, dtype or self.param_dtype, alloc, dst,
                                                adapter_only=adapter_only)
        return iter_weight_buckets(self.model, bucket_bytes, dtype or self.param_dtype, alloc, dst,
                                   adapter_only=adapter_only)

    def local_weights(self) -> list[list[tuple[str, torch.Tensor]]] | None:
        """Every parameter whole and uncast, as its HF pieces, when this rank holds them all (a
        world of one), else None (see `tandem.weights.source.WeightSource`); the adapters alone
        while `sync_adapters`."""
        return local_parameters(self.model, self.sync_adapters) if self.pipeline is None else None

    def num_parameters(self) -> int:
        """Elements of the whole model (every stage's under pipeline parallelism; tied weights once)."""
        if self.pipeline is not None:
            return self.pipeline.num_parameters()
        return sum(p.numel() for p in self.model.parameters())

    def export_nbytes(self, dtype: torch.dtype | None) -> int:
        if self.pipeline is not None:
            return self.pipeline.export_nbytes(dtype or self.param_dtype, adapter_only=self.sync_adapters)
        return export_nbytes(self.model, dtype or self.param_dtype, adapter_only=self.sync_adapters)

    def save_state(self, path: str | Path) -> Path:
        """Everything needed to continue exactly where this step left off (under LoRA: not the frozen
        base, and the adapter as a PEFT directory beside it, `ADAPTER_DIR`). Collective."""
        extra = {"step": self.step, "lr_schedule": self.lr_schedule.state_dict()}
        root = ckpt.save_train_state(path, self.model, self.optimizer, extra)
        if self.lora is not None:
            self.save_adapter(root / ADAPTER_DIR, overwrite=True)
        return root

    def load_state(self, path: str | Path) -> None:
        extra: dict[str, Any] = ckpt.load_train_state(path, self.model, self.optimizer)
        self.step = int(extra["step"])
        self.lr_schedule.load_state_dict(extra["lr_schedule"])

    def close(self) -> None:
        """Destroy the process group if this engine created it."""
        if self._owns_group and dist.is_initialized():
            dist.destroy_process_group()
        self._owns_group = False

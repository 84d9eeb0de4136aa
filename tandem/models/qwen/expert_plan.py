"""Expert-parallel (EP) and expert-tensor-parallel (ETP) plan of Qwen3-MoE blocks.

Expert weights become DTensors (`Shard(0)` over the ep mesh; with ETP also their hidden units over
the TP mesh), so `full_tensor()` is the whole stacked weight; `experts.dispatch` goes through
`expert_parallel_dispatch` under EP. Under TP (etp == tp or etp == 1) the names of gradients that
are partial sums per TP rank are returned for `TensorParallelInfo.partial_grad_params`, and the
recorded routes have one row per padded token. Layouts: docs/parallelism.md, "Mixture-of-experts layouts"."""

from __future__ import annotations

from functools import partial

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Shard, distribute_tensor

from tandem.errors import ConfigError
from tandem.models.common.moe import GroupedExperts, Routing, grouped_swiglu
from tandem.parallel.expert_parallel import expert_parallel_dispatch, gather_tokens, reduce_scatter_tokens
from tandem.parallel.tensor_parallel import check_divides, local_tensor

_HIDDEN_DIM = {"w1": 1, "w3": 1, "w2": 2}


def check_expert_layout(args, ep: int, etp: int) -> None:
    """Raise `ConfigError` unless ep divides the experts and etp their hidden size."""
    if args.num_experts % ep:
        raise ConfigError(f"expert parallel size ep={ep} must divide the model's num_experts ({args.num_experts}): "
                          f"choose an 'e' of actor.backend that divides it")
    if etp > 1:
        check_divides(etp, moe_intermediate_size=args.moe_intermediate_size)


def _distribute_experts(experts: GroupedExperts, mesh: DeviceMesh, ep: bool, etp: bool) -> None:
    for name in ("w1", "w2", "w3"):
        placements: list[Placement] = ([Shard(0)] if ep else []) + ([Shard(_HIDDEN_DIM[name])] if etp else [])
        param = getattr(experts, name)
        experts.register_parameter(name, nn.Parameter(distribute_tensor(param.data, mesh, placements),
                                                      requires_grad=param.requires_grad))


def _dispatch(experts: GroupedExperts, group: dist.ProcessGroup | None, x_sorted: torch.Tensor,
              counts: torch.Tensor) -> torch.Tensor:
    compute = partial(grouped_swiglu, w1=local_tensor(experts.w1), w2=local_tensor(experts.w2),
                      w3=local_tensor(experts.w3))
    if group is None:
        return compute(x_sorted, counts)
    return expert_parallel_dispatch(x_sorted, counts, compute, group)


def _tp_rows(routing: Routing | None, layer: int, rows: tuple[int, int], total: int) -> Routing | None:
    """A view of `routing` whose replayed routes of `layer` are rows [start, stop) of the padded
    token stream (`total` rows; rows past the given routes route live). Records land in `routing`."""
    if routing is None or routing.replay is None or layer not in routing.replay:
        return routing
    replay = routing.replay[layer]
    if replay.shape[0] < total:
        replay = torch.cat([replay, replay.new_full((total - replay.shape[0], *replay.shape[1:]), -1)])
    return routing.with_replay({layer: replay[rows[0]: rows[1]]})


class _MoeTokens:
    """Forward hooks of a MoE block under tensor parallelism (see the module docstring)."""

    def __init__(self, tp_mesh: DeviceMesh, expert_tp: bool):
        self.group, self.expert_tp = tp_mesh.get_group(), expert_tp
        self.size, self.rank = tp_mesh.size(), tp_mesh.get_local_rank()

    def before(self, module: nn.Module, args: tuple) -> tuple:
        x, *rest = args
        x = x.to_local() if isinstance(x, DTensor) else x
        routing = rest[0] if rest else None
        shard = x.shape[0]
        total = shard * self.size
        if self.expert_tp:
            x = gather_tokens(x, self.group)
            routing = _tp_rows(routing, module.layer, (0, total), total)
        else:
            routing = _tp_rows(routing, module.layer, (self.rank * shard, (self.rank + 1) * shard), total)
        return (x, routing)

    def after(self, module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
        routing = args[1] if len(args) > 1 else None
        for records in () if self.expert_tp or routing is None else (routing.recorded, routing.live):
            if module.layer in records:
                local = records[module.layer].contiguous()
                full = local.new_empty((local.shape[0] * self.size, *local.shape[1:]))
                dist.all_gather_into_tensor(full, local, group=self.group)
                records[module.layer] = full
        return reduce_scatter_tokens(output, self.group) if self.expert_tp else output


def apply_expert_parallel(model: nn.Module, *, ep_mesh: DeviceMesh | None, tp_mesh: DeviceMesh | None,
                          expert_tp: bool, experts_mesh: DeviceMesh | None, ep_folds_tp: bool = False) -> list[str]:
    """Lay out every MoE block of `model` (a `QwenModel` or a pipeline rank's part, on any device)
    in place, after the dense TP plan. `ep_mesh`: the 1-D expert-parallel mesh (None: no EP);
    `tp_mesh`: the attention's TP mesh (None without TP); `expert_tp`: experts tensor-parallel over
    it (etp == tp); `experts_mesh`: the mesh the expert weights are DTensors on (`ep` and/or `tp`
    dims, in that order; None when neither); `ep_folds_tp`: the ep mesh spans the TP ranks (each TP
    rank holds its own experts and dispatches its sequence shard's tokens to every ep rank). Returns
    the names of parameters whose gradients are partial over the TP group."""
    partial_grads: list[str] = []
    for key, block in model.layers.items():
        moe = getattr(block, "moe", None)
        if moe is None:
            continue
        if experts_mesh is not None:
            _distribute_experts(moe.experts, experts_mesh, ep_mesh is not None, expert_tp)
        moe.experts.dispatch = partial(_dispatch, moe.experts, ep_mesh.get_group() if ep_mesh is not None else None)
        if tp_mesh is not None:
            tokens = _MoeTokens(tp_mesh, expert_tp)
            moe.register_forward_pre_hook(tokens.before)
            moe.register_forward_hook(tokens.after)
            partial_grads.append(f"layers.{key}.moe.router.weight")
            if not expert_tp and not ep_folds_tp:  # whole experts on every TP rank, each its own tokens
                partial_grads += [f"layers.{key}.moe.experts.{w}" for w in ("w1", "w2", "w3")]
    return partial_grads

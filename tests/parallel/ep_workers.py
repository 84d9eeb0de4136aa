"""Worker bodies of the expert-parallel tests (module level, so spawned processes can import them)."""

from __future__ import annotations

from functools import partial

import torch
import torch.distributed as dist

from tandem.models.common.moe import GroupedExperts, grouped_swiglu
from tandem.parallel.expert_parallel import expert_parallel_dispatch

NUM_EXPERTS, DIM, HIDDEN, TOP_K = 4, 8, 6, 2
# Per rank and call: the experts its (token, slot) assignments go to. Call 0: rank 0 sends rows to
# experts 0, 1 and 3 (none to expert 2), rank 1 only to its own experts 2 and 3, so its split
# towards rank 0 is empty. Call 1: rank 1 has no tokens at all.
ROUTES = [
    [[[0, 1], [3, 0], [0, 3], [1, 0], [3, 1]], [[2, 3], [3, 2], [2, 3]]],
    [[[1, 2], [2, 0]], []],
]


def _experts() -> GroupedExperts:
    torch.manual_seed(0)
    experts = GroupedExperts(NUM_EXPERTS, DIM, HIDDEN)
    with torch.no_grad():
        for w in (experts.w1, experts.w2, experts.w3):
            w.normal_(0, 0.3)
    return experts


def _inputs(call: int, rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    ids = torch.tensor(ROUTES[call][rank], dtype=torch.long).reshape(-1, TOP_K)
    g = torch.Generator().manual_seed(10 * call + rank)
    x = torch.randn(ids.shape[0], DIM, generator=g)
    weights = torch.rand(ids.shape, generator=g)
    grad_out = torch.randn(ids.shape[0], DIM, generator=g)
    return x, ids, weights, grad_out


def dispatch_worker(rank: int, world_size: int) -> dict[str, float]:
    """Max differences of the EP layer (this rank's outputs, input grads and local expert grads)
    from the plain layer run on every rank's tokens, over two calls (uneven and empty splits)."""
    group = dist.group.WORLD
    local = NUM_EXPERTS // world_size
    mine = slice(rank * local, (rank + 1) * local)
    reference, ep = _experts(), _experts()
    # EP: this rank's slice of the stacked weights as its own leaves.
    shards = [w.detach()[mine].clone().requires_grad_() for w in (ep.w1, ep.w2, ep.w3)]
    compute = partial(grouped_swiglu, w1=shards[0], w2=shards[1], w3=shards[2])
    ep.dispatch = lambda x, counts: expert_parallel_dispatch(x, counts, compute, group)
    diffs = {"out": 0.0, "x_grad": 0.0, "w_grad": 0.0}
    for call in range(len(ROUTES)):
        for r in range(world_size):  # the reference sees every rank's tokens; gradients sum
            x, ids, weights, grad_out = _inputs(call, r)
            x.requires_grad_()
            out = reference(x, ids, weights)
            out.backward(grad_out)
            if r == rank:
                ref_out, ref_x_grad = out.detach(), x.grad
        x, ids, weights, grad_out = _inputs(call, rank)
        x.requires_grad_()
        out = ep(x, ids, weights)
        out.backward(grad_out)
        diffs["out"] = max(diffs["out"], (out - ref_out).abs().max().item() if out.numel() else 0.0)
        diffs["x_grad"] = max(diffs["x_grad"], (x.grad - ref_x_grad).abs().max().item() if x.numel() else 0.0)
    for shard, full in zip(shards, (reference.w1, reference.w2, reference.w3), strict=True):
        diffs["w_grad"] = max(diffs["w_grad"], (shard.grad - full.grad[mine]).abs().max().item())
    diffs["w_grad_norm"] = sum(float(s.grad.norm()) for s in shards)
    return diffs


def layout_worker(rank: int, world_size: int, model_dir: str, out_dir: str, backend: str) -> dict:
    """The expert layout a TrainEngine builds for `backend` on this rank: the log line, the
    local shape and placements of one expert weight and whether its `full_tensor()` is the
    checkpoint's stacked weight; then 3 training steps with a DCP state saved after 2, and step 3
    again from that state in a new engine."""
    from tandem.config.alloc import parse_allocation
    from tandem.models import load_model
    from tandem.train.engine import TrainEngine
    from tests.train.helpers import engine_config, make_batch, train_steps

    sizes = parse_allocation(backend).components[0].sizes
    config = dict(path=model_dir, tp=sizes.tp, pp=sizes.pp, cp=sizes.cp, ep=sizes.ep, etp=sizes.etp)
    engine = TrainEngine(engine_config(**config))
    w1 = dict(engine.model.named_parameters())["layers.0.moe.experts.w1"]
    full = w1.full_tensor()
    reference = load_model(model_dir).layers["0"].moe.experts.w1
    res = {"describe": engine.parallel_dims.describe(), "local": tuple(w1.to_local().shape),
           "placements": str(w1.placements), "full_equal": bool(torch.equal(full, reference))}
    batch = make_batch(512)
    local = batch.select(list(range(rank, len(batch), world_size)))  # this data-parallel rank's shard
    res["stats"] = train_steps(engine, local, 2)
    engine.save_state(f"{out_dir}/state")
    res["stats"] += train_steps(engine, local, 1)
    engine.close()
    resumed = TrainEngine(engine_config(**config))
    resumed.load_state(f"{out_dir}/state")
    res["resumed"] = train_steps(resumed, local, 1)[0]
    resumed.close()
    return res



def expert_mesh_worker(rank: int, world_size: int, model_dir: str, backend: str) -> dict:
    """Which experts this rank's engine holds for `backend` (the first expert's index in the
    checkpoint, found by comparing the local shard with the stacked weight) and its place on the
    expert-parallel group, next to what `tandem alloc` explains for the rank."""
    from tandem.config.alloc import parse_allocation
    from tandem.models import load_model
    from tandem.train.engine import TrainEngine
    from tests.train.helpers import engine_config

    sizes = parse_allocation(backend).components[0].sizes
    engine = TrainEngine(engine_config(path=model_dir, tp=sizes.tp, pp=sizes.pp, cp=sizes.cp, ep=sizes.ep,
                                       etp=sizes.etp))
    local = dict(engine.model.named_parameters())["layers.0.moe.experts.w1"].to_local()
    stacked = load_model(model_dir).layers["0"].moe.experts.w1
    # Under ETP each expert's hidden units are split too: this rank's slice of them.
    dim = next((d for d in (1, 2) if local.shape[d] != stacked.shape[d]), None)
    if dim is not None:
        size = local.shape[dim]
        stacked = stacked.narrow(dim, engine.parallel_dims.etp_mesh(engine.mesh).get_local_rank() * size, size)
    first = next(i for i in range(stacked.shape[0]) if torch.equal(stacked[i], local[0]))
    held = list(range(first, first + local.shape[0]))
    assert torch.equal(stacked[first: first + local.shape[0]], local)
    ep_group = engine.parallel_dims.ep_mesh(engine.mesh).get_group()
    res = {"held": held, "ep_rank": dist.get_rank(ep_group),
           "ep_peers": sorted(dist.get_global_rank(ep_group, i) for i in range(dist.get_world_size(ep_group))),
           "explained": sizes.expert_coords(rank)}
    engine.close()
    return res

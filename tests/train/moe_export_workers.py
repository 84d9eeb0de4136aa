"""Worker bodies of the MoE weight-export tests (module level, so spawn can import them)."""

from __future__ import annotations

from pathlib import Path

import torch

from tandem.train import TrainEngine
from tests.train.helpers import engine_config

EXPORT_BYTES = 20_000  # the tiny MoE (~1 MB in fp32) in a few dozen buckets; an expert stack (~16 KB) fits one


def moe_export(rank: int, world_size: int, model_dir: str, out_dir: str, ep: int = 1) -> dict:
    """A tiny MoE's export from a `TrainEngine` (FSDP over the world; experts over `ep` ranks):
    every rank's buckets, rank 0's gathered straight into per-HF-tensor destinations (`alloc`,
    `dst=0`), `save_hf`, and the engine's own byte count and local view."""
    engine = TrainEngine(engine_config(model_dir, ep=ep))
    w1 = dict(engine.model.named_parameters())["layers.0.moe.experts.w1"]
    res_layout = (tuple(w1.to_local().shape), str(w1.placements)) if ep > 1 else None
    res: dict = {"layout": res_layout}
    res["buckets"] = [[(n, t.clone()) for n, t in b] for b in engine.export_weights(EXPORT_BYTES, torch.float32)]
    given: dict[str, torch.Tensor] = {}

    def alloc(names, shapes, dtype, device):
        dests = [torch.empty(s, dtype=dtype, device=device) for s in shapes]
        given.update(zip(names, dests, strict=True))
        return dests

    to_rank0 = [b for b in engine.export_weights(EXPORT_BYTES, torch.bfloat16, alloc=alloc, dst=0)]
    res["to_rank0"] = [(n, t.clone()) for b in to_rank0 for n, t in b]
    res["in_alloc"] = all(t.data_ptr() == given[n].data_ptr() for b in to_rank0 for n, t in b)
    res["nbytes"] = engine.export_nbytes(torch.float32)
    local = engine.local_weights()
    res["local"] = None if local is None else [[(n, t.clone()) for n, t in group] for group in local]
    engine.save_hf(Path(out_dir) / "hf")
    engine.close()
    return res


def gather_pieces(rank: int, world_size: int) -> dict:
    """`gather_bucket` of a stacked parameter given as pieces: sharded on dim 0 unevenly (the fused
    all-gather), on dim 1 (the `full_tensor` fallback, as any non-FSDP placement), and replicated;
    each without and with `alloc` (one destination per piece)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from tandem.train.weight_export import gather_bucket

    mesh = init_device_mesh("cpu", (world_size,))
    g = torch.Generator().manual_seed(0)
    full = torch.randn(5, 3, 2, generator=g)  # 5 "experts": 3 + 2 rows over two ranks
    pieces = [(f"e{i}", i) for i in range(5)]
    out: dict = {}
    for label, placement in (("shard0", Shard(0)), ("shard1", Shard(1)), ("replicate", Replicate())):
        dt = distribute_tensor(full, mesh, [placement])
        entries = [(pieces, dt), ("whole", distribute_tensor(full[:, :, 0].contiguous(), mesh, [placement]))]
        views = gather_bucket(entries, torch.bfloat16)
        dests: list[torch.Tensor] = []
        written = gather_bucket(entries, torch.bfloat16, {}, alloc=_nan_alloc(dests))
        expected = [(f"e{i}", full[i].to(torch.bfloat16)) for i in range(5)] + [("whole", full[:, :, 0].bfloat16())]
        out[label] = {
            "names": [n for n, _ in views] == [n for n, _ in expected] == [n for n, _ in written],
            "views": all(torch.equal(t, e) for (_, t), (_, e) in zip(views, expected, strict=True)),
            "written": all(torch.equal(t, e) for (_, t), (_, e) in zip(written, expected, strict=True)),
            "in_dests": [t.data_ptr() for _, t in written] == [d.data_ptr() for d in dests],
        }
    return out


def _nan_alloc(dests: list[torch.Tensor]):
    """An `Alloc` that hands out NaN-filled tensors (so a piece left unwritten shows) and keeps them."""
    def alloc(names, shapes, dtype, device):
        dests.extend(torch.full(s, float("nan"), dtype=dtype, device=device) for s in shapes)
        return dests
    return alloc


def moe_pipeline_export(rank: int, world_size: int, model_dir: str, out_dir: str, ep: int = 1) -> dict:
    """The same export from a pipeline-parallel engine (pp=2, one MoE layer per stage; experts over
    `ep` ranks): to every rank, to rank 0 into per-HF-tensor destinations, and saved."""
    from tests.train.pp_workers import pp_engine

    engine = pp_engine(model_dir, "1F1B", pp=2, ep=ep)
    res: dict = {"buckets": [[(n, t.clone()) for n, t in b] for b in engine.export_weights(EXPORT_BYTES,
                                                                                           torch.float32)]}
    given: dict[str, torch.Tensor] = {}

    def alloc(names, shapes, dtype, device):
        dests = [torch.empty(s, dtype=dtype, device=device) for s in shapes]
        given.update(zip(names, dests, strict=True))
        return dests

    to_rank0 = list(engine.export_weights(EXPORT_BYTES, torch.bfloat16, alloc=alloc, dst=0))
    res["to_rank0"] = [(n, t.clone()) for b in to_rank0 for n, t in b]
    res["in_alloc"] = all(t.data_ptr() == given[n].data_ptr() for b in to_rank0 for n, t in b)
    res["nbytes"] = engine.export_nbytes(torch.float32)
    engine.save_hf(Path(out_dir) / "hf")
    engine.close()
    return res


def ep_like_export(rank: int, world_size: int, model_dir: str) -> dict:
    """A tiny MoE laid out as expert parallelism lays it out: every expert stack a DTensor sharded on
    dim 0 (experts) over an "ep" mesh, everything else replicated over another mesh: buckets mix
    meshes, so nothing is fused and each parameter goes through `full_tensor()`. The export (to
    every rank, and to rank 0) must still be the checkpoint's HF tensors."""
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from tandem.models import load_model
    from tandem.train.weight_export import iter_weight_buckets

    model = load_model(model_dir)
    ep = init_device_mesh("cpu", (world_size,), mesh_dim_names=("ep",))
    dp = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp",))
    for module in list(model.modules()):
        for name, p in list(module.named_parameters(recurse=False)):
            experts = type(module).__name__ == "GroupedExperts"
            mesh, placement = (ep, Shard(0)) if experts else (dp, Replicate())
            module.register_parameter(name, nn.Parameter(distribute_tensor(p.detach(), mesh, [placement])))
    stacks = [p for n, p in model.named_parameters() if ".experts." in n]
    everywhere = [(n, t.clone()) for b in iter_weight_buckets(model, EXPORT_BYTES, torch.float32) for n, t in b]
    to_rank0 = [(n, t.clone()) for b in iter_weight_buckets(model, EXPORT_BYTES, torch.bfloat16, dst=0) for n, t in b]
    return {"sharded": bool(stacks) and all(p.to_local().shape[0] == p.shape[0] // world_size for p in stacks),
            "everywhere": everywhere, "to_rank0": to_rank0}

"""Worker bodies of the MoE weight-export tests (module level, so spawn can import them)."""

from __future__ import annotations

from pathlib import Path

import torch

from tandem.train import TrainEngine
from tests.train.helpers import engine_config

EXPORT_BYTES = 20_000  # the tiny MoE (~1 MB in fp32) in a few dozen buckets; an expert stack (~16 KB) fits one


def moe_export(rank: int, world_size: int, model_dir: str, out_dir: str) -> dict:
    """A tiny MoE's export from a `TrainEngine` (FSDP over the world): every rank's buckets, rank
    0's gathered straight into per-HF-tensor destinations (`alloc`, `dst=0`), `save_hf`, and the
    engine's own byte count and local view."""
    engine = TrainEngine(engine_config(model_dir))
    res: dict = {}
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


def moe_pipeline_export(rank: int, world_size: int, model_dir: str, out_dir: str) -> dict:
    """The same export from a pipeline-parallel engine (pp = world, one MoE layer per stage): to
    every rank, to rank 0 into per-HF-tensor destinations, and saved."""
    from tests.train.pp_workers import pp_engine

    engine = pp_engine(model_dir, "1F1B", pp=world_size)
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

"""Worker bodies for the multi-process engine tests (module level, so spawn can import them)."""

from __future__ import annotations

from pathlib import Path

import torch

from tandem.data.balance import karmarkar_karp
from tandem.train import MicroBatchConfig, TrainEngine, plan_micro_batches
from tandem.train.config import OptimizerConfig
from tests.train.helpers import engine_config, full_params, make_batch, train_steps, weighted_loss

SCHEDULE = dict(
    optimizer=OptimizerConfig(lr=1e-3, lr_scheduler="cosine", warmup_steps_proportion=0.25, min_lr_ratio=0.1),
    total_train_steps=4,
)
MAIN_MB = MicroBatchConfig(n_mbs=2)
UNEVEN_MB = MicroBatchConfig(max_tokens_per_mb=48, packing="kk")
EXPORT_BYTES = 40_000


def split(world_size: int) -> list[list[int]]:
    """The controller's split of the global batch over DP ranks (balanced by tokens)."""
    return karmarkar_karp(make_batch(512).lengths, world_size)


def uneven_split(world_size: int) -> list[list[int]]:
    """Rank 0 gets one short sequence, the other ranks the rest: rank 0 must pad micro-batches."""
    n = len(make_batch(512))
    rest = list(range(1, n))
    return [[0]] + [rest[r::world_size - 1] for r in range(world_size - 1)]


def engine_checks(rank: int, world_size: int, path: str, out_dir: str) -> dict:
    out = Path(out_dir)
    batch = make_batch(512)
    local = batch.select(split(world_size)[rank])
    res: dict = {}

    engine = TrainEngine(engine_config(path, mb=MAIN_MB, **SCHEDULE))
    stats = train_steps(engine, local, 2)
    engine.save_state(out / "state")
    stats += train_steps(engine, local, 1)
    res["stats"] = stats
    res["params"] = full_params(engine)
    res["logprobs"] = engine.forward_logprobs(local).logprobs
    res["export"] = [[(n, t.clone()) for n, t in b] for b in engine.export_weights(EXPORT_BYTES, torch.float32)]
    engine.save_hf(out / "hf")
    engine.close()

    resumed = TrainEngine(engine_config(path, mb=MAIN_MB, **SCHEDULE))
    resumed.load_state(out / "state")
    res["resumed"] = train_steps(resumed, local, 1)[0]
    resumed.close()

    uneven = batch.select(uneven_split(world_size)[rank])
    res["plan"] = plan_micro_batches(uneven.lengths, UNEVEN_MB)
    engine = TrainEngine(engine_config(path, mb=UNEVEN_MB))
    res["uneven"] = train_steps(engine, uneven, 1)[0]
    res["uneven_logprobs"] = engine.forward_logprobs(uneven).logprobs
    engine.close()
    return res


def gather_bucket_checks(rank: int, world_size: int, mesh_shape: tuple[int, ...]) -> dict:
    """`gather_bucket` against DTensor's own `full_tensor()`, per parameter, on FSDP-like (Shard(0))
    and HSDP-like (Replicate, Shard(0)) placements, with row counts that do not divide the world
    (some ranks hold empty shards), a bf16 cast, and a bucket that mixes in a replicated tensor
    (the per-parameter fallback). Also counts the all-gathers the fused path makes (one per bucket)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from tandem.train import weight_export

    mesh = init_device_mesh("cpu", mesh_shape)
    placements = [Shard(0)] if len(mesh_shape) == 1 else [Replicate(), Shard(0)]
    g = torch.Generator().manual_seed(0)  # the same global tensors on every rank
    shapes = [(7, 5), (2, 3), (1,), (10,), (5, 2, 3)]
    globals_ = [torch.randn(s, generator=g) for s in shapes]
    params = [(f"p{i}", distribute_tensor(t, mesh, placements)) for i, t in enumerate(globals_)]
    calls = []
    real = weight_export.all_gather_flat
    weight_export.all_gather_flat = lambda *a, **k: calls.append(1) or real(*a, **k)
    try:
        # Three buckets sharing the gather buffer, as in one export; the first (one tensor, so the
        # whole buffer) is the largest, so the later ones reuse its memory: it must stay intact.
        scratch: dict = {}
        fused = weight_export.gather_bucket(params[:1], torch.bfloat16, scratch)
        fused += weight_export.gather_bucket(params[1:4], torch.bfloat16, scratch)
        fused += weight_export.gather_bucket(params[4:], torch.bfloat16, scratch)
        fused_calls = len(calls)
        replicated = distribute_tensor(globals_[3], mesh, [Replicate()] * len(mesh_shape))
        mixed = weight_export.gather_bucket([*params[:2], ("r", replicated)])
        # Only global rank 0 needs the tensors: the others get [] (HSDP: the other replica's
        # ranks do not communicate at all).
        to_rank0 = weight_export.gather_bucket(params, torch.bfloat16, {}, dst=0)
    finally:
        weight_export.all_gather_flat = real
    return {
        "fused_calls": fused_calls,
        "fused_equal": [torch.equal(t, p.to(torch.bfloat16).full_tensor()) and t.dtype == torch.bfloat16
                        for (_, t), (_, p) in zip(fused, params, strict=True)],
        "fused_exact": [torch.equal(t, g_.to(torch.bfloat16)) for (_, t), g_ in zip(fused, globals_, strict=True)],
        "mixed_equal": [torch.equal(t, g_) for (_, t), g_ in zip(mixed, [*globals_[:2], globals_[3]], strict=True)],
        "names": [n for n, _ in fused] + [n for n, _ in mixed],
        "to_rank0": [torch.equal(t, g_.to(torch.bfloat16)) for (_, t), g_ in zip(to_rank0, globals_, strict=True)]
        if rank == 0 else to_rank0,
        "all_gathers_after": len(calls) - fused_calls,
    }


def oracle_steps(rank: int, world_size: int, path: str, optimizer: OptimizerConfig, total_steps: int) -> dict:
    """Two steps of the global batch split over the ranks (`split`), the full weights after each;
    then a third step whose gradient is NaN on the last rank's shard only (one advantage)."""
    batch = make_batch(512)
    local = batch.select(split(world_size)[rank])
    engine = TrainEngine(engine_config(path, optimizer=optimizer, total_train_steps=total_steps))
    res: dict = {"stats": [], "params": []}
    for _ in range(2):
        res["stats"].append(engine.train_batch(local, weighted_loss))
        res["params"].append(full_params(engine))
    if rank == world_size - 1:
        local.seqs[0]["advantages"][-1] = float("nan")
    res["nan_step"] = engine.train_batch(local, weighted_loss)
    res["after_nan"] = full_params(engine)
    engine.close()
    return res

"""Worker bodies of the LoRA layout tests (module level, so spawn can import them): one LoRA engine
per layout on this rank's share of the global batch, every check of the layout on it."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch

from tandem.config.parallel_sizes import ParallelSizes
from tandem.models.common.lora import LoRAConfig
from tandem.parallel import ParallelizeConfig
from tandem.train import MicroBatchConfig, SequenceBatch, TrainEngine
from tandem.train.config import OptimizerConfig
from tandem.train.losses import sft_loss
from tests.train.dist_workers import split
from tests.train.helpers import engine_config, make_batch, train_steps

LORA = LoRAConfig(rank=4, alpha=8.0)
# tests/train/tp_workers.py's schedule (Adam eps 1e-6: see there why), clipped below the adapters'
# grad norms (~0.48 on the dense model, ~0.31 on the MoE one) so that every step's clipping counts.
SCHEDULE = dict(
    optimizer=OptimizerConfig(lr=1e-3, eps=1e-6, lr_scheduler="cosine", warmup_steps_proportion=0.25,
                              min_lr_ratio=0.1, gradient_clipping=0.25),
    total_train_steps=4,
)
MB = MicroBatchConfig(n_mbs=4)  # per rank; the pipeline schedules at pp=2 run them as d1 plans them
STEPS = 3
EXPORT_BYTES = 40_000  # several buckets of adapters, and of merged weights
# name -> (world size, the engine's sizes: the rest of the world is data parallel; pp with its schedule)
LAYOUTS = {"d2": (2, {}), "t2": (2, {"tp": 2}), "p2": (2, {"pp": 2, "parallelize": {"pp_schedule": "1F1B"}}),
           # zero-bubble: the weights' gradients computed apart from the inputs', layers 0 and 3 on rank 0
           "p2-zbv": (2, {"pp": 2, "parallelize": {"pp_schedule": "ZBVZeroBubble"}}),
           "c2": (2, {"cp": 2}),
           "d2t2": (4, {"tp": 2}),  # FSDP x TP on one mesh
           "p2d2": (4, {"pp": 2, "parallelize": {"pp_schedule": "1F1B"}})}  # each stage FSDP over 2 ranks
BF16_LAYOUTS = ("d2", "t2", "p2")
MOE_STEPS = 2
# archon:d2e2 (world 2: 4 of the 8 experts on each rank, FSDP over both) and archon:d4e2 (world 4:
# dp 4, experts split over ep pairs, each half FSDP-sharded over 2 ranks: edp 2)
MOE_LAYOUTS = {"d2e2": (2, {"ep": 2}), "d4e2": (4, {"ep": 2})}


def lora_engine(path: str, lora: LoRAConfig = LORA, **sizes) -> TrainEngine:
    sizes = dict(sizes)
    parallelize = ParallelizeConfig(**sizes.pop("parallelize", {}))
    return TrainEngine(engine_config(path, mb=MB, lora=lora, parallelize=parallelize, **SCHEDULE, **sizes))


def buckets_to_rank0(engine: TrainEngine, adapter_only: bool) -> list[list[tuple[str, torch.Tensor]]]:
    return [[(n, t.clone()) for n, t in b]
            for b in engine.export_weights(EXPORT_BYTES, torch.float32, dst=0, adapter_only=adapter_only)]


def share(world_size: int, rank: int, sizes: dict) -> tuple[list[int], SequenceBatch]:
    """(the global batch's indices this rank trains on, their batch): its data-parallel rank's
    share (the controller's split)."""
    dims = ParallelSizes(dp=world_size // (sizes.get("tp", 1) * sizes.get("pp", 1) * sizes.get("cp", 1)),
                         tp=sizes.get("tp", 1), pp=sizes.get("pp", 1), cp=sizes.get("cp", 1))
    batch = make_batch(512)
    indices = split(dims.dp)[dims.dp_rank(rank)] if dims.dp > 1 else list(range(len(batch)))
    return indices, batch.select(indices)


def layout_checks(rank: int, world_size: int, path: str, out_dir: str, sizes: dict) -> dict:
    """One layout: STEPS steps (a DCP state saved after 2), the adapters and the merged weights
    exported to rank 0 (merged: refused under pp), the log-probs of this rank's share, a saved
    PEFT adapter; then a fresh engine resumed from the state runs step 3 again, and one started
    from the saved adapter (`lora.path`) gives its log-probs."""
    out = Path(out_dir)
    indices, local = share(world_size, rank, sizes)
    res: dict = {"indices": indices}
    engine = lora_engine(path, **sizes)
    res["trainable"] = {n: (str(getattr(p, "placements", None)), p.dtype)
                        for n, p in engine.model.named_parameters() if p.requires_grad}
    stats = train_steps(engine, local, 2)
    engine.save_state(out / "state")
    res["stats"] = stats + train_steps(engine, local, STEPS - 2)
    res["adapter"] = buckets_to_rank0(engine, adapter_only=True)
    try:
        res["merged"] = buckets_to_rank0(engine, adapter_only=False)
    except NotImplementedError as e:
        res["merged"] = str(e)
    res["logprobs"] = engine.forward_logprobs(local).logprobs
    engine.save_adapter(out / "adapter")
    engine.close()
    resumed = lora_engine(path, **sizes)
    resumed.load_state(out / "state")
    res["resumed"] = train_steps(resumed, local, 1)[0]
    res["resumed_adapter"] = buckets_to_rank0(resumed, adapter_only=True)
    resumed.close()
    started = lora_engine(path, lora=replace(LORA, path=str(out / "adapter")), **sizes)
    res["started_logprobs"] = started.forward_logprobs(local).logprobs
    started.close()
    return res


def bf16_checks(rank: int, world_size: int, path: str, sizes: dict) -> dict:
    """A layout in bfloat16: FSDP casts for compute, the frozen base is held in bfloat16, the
    adapters in float32; two steps on this rank's share."""
    engine = lora_engine(path, dtype="bfloat16", **sizes)
    params = dict(engine.model.named_parameters())
    res = {"dtypes": {n: (p.dtype, p.requires_grad) for n, p in params.items()},
           "before": buckets_to_rank0(engine, adapter_only=True)}
    res["stats"] = train_steps(engine, share(world_size, rank, sizes)[1], 2)
    res["after"] = buckets_to_rank0(engine, adapter_only=True)
    engine.close()
    return res


def moe_sft(rank: int, world_size: int, path: str, sizes: dict, steps: int = MOE_STEPS) -> dict:
    """`steps` SFT steps (`sft_loss`) of a LoRA engine on this rank's share: per-step stats and
    the adapters (to rank 0) after each, then the share's log-probs."""
    indices, local = share(world_size, rank, sizes)
    engine = lora_engine(path, **sizes)
    res: dict = {"indices": indices, "stats": [], "adapters": []}
    for _ in range(steps):
        res["stats"].append(engine.train_batch(local, sft_loss))
        res["adapters"].append(buckets_to_rank0(engine, adapter_only=True))
    res["logprobs"] = engine.forward_logprobs(local).logprobs
    engine.close()
    return res


def all_layouts(rank: int, world_size: int, dense: str, moe: str, out_dir: str) -> dict:
    """Every layout of `LAYOUTS` and `MOE_LAYOUTS` at this world size, and those of `BF16_LAYOUTS`
    in bfloat16: one spawned group for all."""
    out = Path(out_dir)
    res: dict = {name: layout_checks(rank, world_size, dense, str(out / name), sizes)
                 for name, (world, sizes) in LAYOUTS.items() if world == world_size}
    res |= {name: moe_sft(rank, world_size, moe, sizes) for name, (world, sizes) in MOE_LAYOUTS.items()
            if world == world_size}
    res |= {f"bf16 {name}": bf16_checks(rank, world_size, dense, sizes) for name, (world, sizes) in LAYOUTS.items()
            if name in BF16_LAYOUTS and world == world_size}
    return res

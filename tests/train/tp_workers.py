"""Worker body of the tensor-parallel engine tests (module level, so spawn can import it)."""

from __future__ import annotations

from pathlib import Path

import torch

from tandem.config.parallel_sizes import ParallelSizes
from tandem.errors import ConfigError
from tandem.train import TrainEngine
from tandem.train.config import OptimizerConfig
from tests.train.dist_workers import EXPORT_BYTES, MAIN_MB, split
from tests.train.helpers import engine_config, full_params, make_batch, train_steps

STEPS = 3
# Adam's eps at 1e-6 (not 1e-8): Adam moves every weight by ~lr whatever its gradient's size, so
# a gradient that is ~0 by cancellation (|g| ~ 1e-9) would turn float32 summation-order noise
# (TP sums in another order than one rank) into weight differences of ~lr. Gradients above ~1e-5
# (nearly all) still get Adam's normalised step. Gradient-norm clipping is on (norms are ~2).
SCHEDULE = dict(
    optimizer=OptimizerConfig(lr=1e-3, eps=1e-6, lr_scheduler="cosine", warmup_steps_proportion=0.25,
                              min_lr_ratio=0.1, gradient_clipping=1.0),
    total_train_steps=4,
)


def tp_engine_checks(rank: int, world_size: int, path: str, out_dir: str, tp: int, compile_blocks: bool) -> dict:
    """`TrainEngine` with tensor parallel size `tp` (the rest data parallel) on this rank's data-
    parallel shard: 3 steps (a DCP state saved after 2), full weights, log-probs, a bucketed export
    to rank 0, `save_hf`; then a resume from the state, and one step with activation checkpointing,
    or with per-block torch.compile instead when `compile_blocks` (both at once are refused under
    TP: torch fails compiling checkpointed DTensor blocks)."""
    out = Path(out_dir)
    sizes = ParallelSizes(dp=world_size // tp, tp=tp)
    batch = make_batch(512)
    local = batch.select(split(sizes.dp)[sizes.dp_rank(rank)]) if sizes.dp > 1 else batch
    res: dict = {"dp_rank": sizes.dp_rank(rank)}

    engine = TrainEngine(engine_config(path, mb=MAIN_MB, tp=tp, **SCHEDULE))
    model = engine.model
    res["placements"] = {n: str(getattr(p, "placements", None)) for n, p in model.named_parameters()}
    res["n_heads_local"] = model.layers["0"].attention.wq.weight.to_local().shape
    stats = train_steps(engine, local, 2)
    engine.save_state(out / "state")
    stats += train_steps(engine, local, STEPS - 2)
    res["stats"] = stats
    res["params"] = full_params(engine)
    res["logprobs"] = engine.forward_logprobs(local).logprobs
    res["export"] = [[(n, t.clone()) for n, t in b] for b in engine.export_weights(EXPORT_BYTES, torch.float32, dst=0)]
    engine.save_hf(out / "hf")
    engine.close()

    resumed = TrainEngine(engine_config(path, mb=MAIN_MB, tp=tp, **SCHEDULE))
    resumed.load_state(out / "state")
    res["resumed"] = train_steps(resumed, local, 1)[0]
    resumed.close()

    config = engine_config(path, mb=MAIN_MB, tp=tp, **SCHEDULE)
    config.parallelize.activation_checkpoint = "full"
    config.parallelize.compile = True
    try:
        TrainEngine(config)
    except ConfigError as e:
        res["refused"] = str(e)
    config.parallelize.activation_checkpoint = "none" if compile_blocks else "full"
    config.parallelize.compile = compile_blocks
    checkpointed = TrainEngine(config)
    res["checkpointed"] = train_steps(checkpointed, local, 1)[0]
    checkpointed.close()
    from torch._dynamo.utils import counters

    res["compiled_graphs"] = counters["stats"]["unique_graphs"]
    return res

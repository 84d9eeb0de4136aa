"""Worker body and model of the context-parallel engine tests (module level, so spawn can import them)."""

from __future__ import annotations

from pathlib import Path

import torch

from tandem.config.parallel_sizes import ParallelSizes
from tandem.models.tiny import init_model
from tandem.parallel import ParallelizeConfig
from tandem.train import TrainEngine
from tandem.train.config import OptimizerConfig
from tests.train.dist_workers import MAIN_MB, UNEVEN_MB, split, uneven_split
from tests.train.helpers import engine_config, full_params, make_batch, train_steps

STEPS = 3
# Adam's eps is raised from 1e-8: a few gradient entries of this model are pure round-off (~1e-9,
# e.g. a document's first key, which only attends to itself), and Adam turns g / (|g| + 1e-8) of
# round-off into weight moves of up to lr. Any change of summation order (d2 as much as c2) then
# moves such a weight by ~1e-4 after 3 steps although every gradient agrees with d1 to ~5e-7 of
# its tensor's scale; with eps=1e-6 the weights show the gradients' agreement.
SCHEDULE = dict(
    optimizer=OptimizerConfig(lr=1e-3, eps=1e-6, lr_scheduler="cosine", warmup_steps_proportion=0.25,
                              min_lr_ratio=0.1),
    total_train_steps=4,
)


def untied_four_layer_model(out_dir: Path) -> Path:
    """The tiny Qwen3 preset with 4 layers and an untied output head (4 query / 2 KV heads)."""
    return init_model(out_dir, arch="qwen3", preset="tiny", seed=0,
                      overrides={"num_hidden_layers": 4, "tie_word_embeddings": False})


def cp_engine_checks(rank: int, world_size: int, path: str, out_dir: str, cps: list[int],
                     checkpointed: bool = False) -> dict:
    """For each cp in `cps` (dp = world_size / cp): STEPS training steps on this rank's DP shard
    of the shared batch, then the full weights, the shard's log-probs and a saved HF directory;
    with dp > 1 also one step on an uneven split (some DP ranks pad with empty micro-batches).
    `checkpointed`: also STEPS steps at cp=world_size with op-level selective activation
    checkpointing (the recompute repeats the attention's all-to-alls), under key "ac"."""
    batch = make_batch(512)
    res: dict = {}
    if checkpointed:
        ac = ParallelizeConfig(activation_checkpoint="selective", ac_selective="op")
        engine = TrainEngine(engine_config(path, mb=MAIN_MB, cp=world_size, parallelize=ac, **SCHEDULE))
        res["ac"] = train_steps(engine, batch, STEPS)
        engine.close()
    for cp in cps:
        sizes = ParallelSizes(dp=world_size // cp, cp=cp)
        dp_rank = sizes.dp_rank(rank)
        local = batch.select(split(sizes.dp)[dp_rank])
        engine = TrainEngine(engine_config(path, mb=MAIN_MB, cp=cp, **SCHEDULE))
        out = {"stats": train_steps(engine, local, STEPS), "dp_rank": dp_rank}
        out["params"] = full_params(engine)
        out["logprobs"] = engine.forward_logprobs(local).logprobs
        out["loss_token_logprobs"] = engine.forward_logprobs(local, loss_tokens_only=True).logprobs
        engine.save_hf(Path(out_dir) / f"c{cp}", overwrite=True)
        engine.close()
        if sizes.dp > 1:
            uneven = batch.select(uneven_split(sizes.dp)[dp_rank])
            engine = TrainEngine(engine_config(path, mb=UNEVEN_MB, cp=cp))
            out["uneven"] = train_steps(engine, uneven, 1)[0]
            engine.close()
        res[cp] = out
    return res


def one_rank_reference(path: str) -> dict:
    """The d1 run of `cp_engine_checks` in this process."""
    batch = make_batch(512)
    engine = TrainEngine(engine_config(path, mb=MAIN_MB, **SCHEDULE))
    res = {"stats": train_steps(engine, batch, STEPS), "params": full_params(engine),
           "logprobs": engine.forward_logprobs(batch).logprobs,
           "loss_token_logprobs": engine.forward_logprobs(batch, loss_tokens_only=True).logprobs}
    engine.close()
    engine = TrainEngine(engine_config(path, mb=UNEVEN_MB))
    res["uneven"] = train_steps(engine, batch, 1)[0]
    engine.close()
    return res


def logprob_diff(got: list[torch.Tensor], indices: list[int], ref: list[torch.Tensor]) -> float:
    return max((lp - ref[i]).abs().max().item() for i, lp in zip(indices, got, strict=True))

"""Worker bodies and models of the pipeline-parallel engine tests (module level, so spawn can
import them)."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from tandem.parallel import ParallelizeConfig
from tandem.train import MicroBatchConfig, TrainEngine
from tests.train.dist_workers import SCHEDULE, split
from tests.train.helpers import engine_config, full_params, make_batch, train_steps

SCHEDULES = ("1F1B", "Interleaved1F1B", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")
# Activation checkpointing under each schedule, each mode the schedule allows (the zero-bubble ones
# take neither op-level selective nor memory-budget checkpointing: ParallelizeConfig.check_pipeline).
AC_CASES = {
    "1F1B full": ("1F1B", {"activation_checkpoint": "full"}),
    "1F1B op": ("1F1B", {"activation_checkpoint": "selective", "ac_selective": "op"}),
    "1F1B budget": ("1F1B", {"activation_checkpoint": "memory_budget", "ac_memory_budget": 0.25, "compile": True}),
    "I1F1B every-2": ("I1F1B", {"activation_checkpoint": "selective", "ac_every": 2}),
    "I1F1B op": ("I1F1B", {"activation_checkpoint": "selective", "ac_selective": "op"}),
    "IZB full": ("IZB", {"activation_checkpoint": "full"}),
    "IZB every-2": ("IZB", {"activation_checkpoint": "selective", "ac_every": 2}),
    "ZBV full": ("ZBV", {"activation_checkpoint": "full"}),
    "DualPipeV full": ("DualPipeV", {"activation_checkpoint": "full"}),
    "DualPipeV every-2": ("DualPipeV", {"activation_checkpoint": "selective", "ac_every": 2}),
}
SHORT = {"I1F1B": "Interleaved1F1B", "IZB": "InterleavedZeroBubble", "ZBV": "ZBVZeroBubble"}
EXPORT_BYTES = 40_000
DP_CASES = (("untied", "1F1B"), ("tied", "ZBV"))  # pp=2 x dp=2 cases: (model, schedule)


def make_model(out_dir: Path, tied: bool, n_layers: int = 4) -> Path:
    """A tiny qwen3 with `n_layers` layers (tied or untied embeddings) as an HF directory."""
    from tandem.models.tiny import init_model

    return init_model(out_dir, arch="qwen3", preset="tiny", seed=0,
                      overrides={"num_hidden_layers": n_layers, "tie_word_embeddings": tied})


def n_mbs(schedule: str) -> int:
    """Micro-batches per step at pp=2: one per stage (the d1 reference uses the same plan, so
    both sum the same micro-batches' gradients)."""
    return 2 if SHORT.get(schedule, schedule) == "1F1B" else 4


def pp_engine(path: str, schedule: str, pp: int = 2, lr_schedule: dict | None = None, **overrides) -> TrainEngine:
    """An engine at pipeline size `pp` with `schedule`; `lr_schedule`: optimizer and step count
    (default `dist_workers.SCHEDULE`)."""
    parallelize = ParallelizeConfig(pp_schedule=schedule, **overrides.pop("parallelize", {}))
    mb = MicroBatchConfig(n_mbs=n_mbs(schedule))
    return TrainEngine(engine_config(path, mb=mb, pp=pp, parallelize=parallelize, **(lr_schedule or SCHEDULE),
                                     **overrides))


def run_case(engine: TrainEngine, batch, steps: int = 3) -> dict:
    """Train `steps` steps, then every full tensor (to all ranks and to rank 0 only) and the logprobs."""
    res = {"stats": train_steps(engine, batch, steps), "params": full_params(engine)}
    res["export_rank0"] = [[(n, t.clone()) for n, t in b] for b in engine.export_weights(EXPORT_BYTES, torch.float32,
                                                                                          dst=0)]
    res["logprobs"] = engine.forward_logprobs(batch).logprobs
    res["nbytes"] = engine.export_nbytes(torch.float32)
    return res


def pipeline_checks(rank: int, world_size: int, untied: str, tied: str, out_dir: str) -> dict:
    """Every schedule at pp=2 (world 2) on the untied model, then the tied model under 1F1B (first
    and last stage on different ranks), ZBV and DualPipeV (both on rank 0), activation
    checkpointing under every schedule (`AC_CASES`), a save_hf and a resume."""
    out = Path(out_dir)
    batch = make_batch(512)
    res: dict = {}
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")  # the compiled AC case: no compile worker pool
    for schedule in SCHEDULES:
        engine = pp_engine(untied, schedule)
        res[schedule] = run_case(engine, batch)
        if schedule == "1F1B":
            engine.save_hf(out / "hf")
        engine.close()
    for schedule in ("1F1B", "ZBV", "DualPipeV"):
        engine = pp_engine(tied, schedule)
        res[f"tied-{schedule}"] = run_case(engine, batch)
        engine.close()
    # Every AC case, and the compiled case's reference: the same layout compiled without checkpointing.
    cases = {f"ac {name}": case for name, case in AC_CASES.items()} | {"ac-ref compiled": ("1F1B", {"compile": True})}
    for key, (schedule, options) in cases.items():
        engine = pp_engine(untied, schedule, parallelize=dict(options))
        res[key] = {"stats": train_steps(engine, batch, 3), "params": full_params(engine),
                    "logprobs": engine.forward_logprobs(batch).logprobs, "checkpointed": _checkpointed_blocks(engine)}
        engine.close()
    # The data-parallel reference of `pipeline_dp_checks` (same DP split, same micro-batch plans).
    for name, schedule in DP_CASES:
        path = untied if name == "untied" else tied
        local = batch.select(split(2)[rank])
        engine = TrainEngine(engine_config(path, mb=MicroBatchConfig(n_mbs=n_mbs(schedule)), **SCHEDULE))
        res[f"d2-{name}"] = {"stats": train_steps(engine, local, 3), "params": full_params(engine)}
        res[f"d2-{name}"]["logprobs"] = engine.forward_logprobs(local).logprobs
        engine.close()
    engine = pp_engine(untied, "I1F1B")
    res["resume-before"] = train_steps(engine, batch, 2)
    engine.save_state(out / "state")
    res["resume-uninterrupted"] = train_steps(engine, batch, 1)[0]
    engine.close()
    engine = pp_engine(untied, "I1F1B")
    engine.load_state(out / "state")
    res["resume-resumed"] = train_steps(engine, batch, 1)[0]
    engine.close()
    return res


def _checkpointed_blocks(engine: TrainEngine) -> int:
    """How many of this rank's blocks run checkpointed (`checkpoint_module` replaces `forward`)."""
    return sum("forward" in vars(block) for stage in engine.pipeline.stages for block in stage.layers.values())


def pipeline_dp_checks(rank: int, world_size: int, untied: str, tied: str) -> dict:
    """pp=2 x dp=2 (FSDP per stage) at world 4, each DP rank with its share of the batch (the
    controller's split), untied under 1F1B and tied under ZBV (rank 0 of each pp group holds
    both copies of the tied weight, each stage its own FSDP unit)."""
    from tandem.config.parallel_sizes import ParallelSizes

    dp_rank = ParallelSizes(dp=2, pp=2).dp_rank(rank)
    local = make_batch(512).select(split(2)[dp_rank])
    res = {}
    for name, schedule in DP_CASES:
        path = untied if name == "untied" else tied
        engine = pp_engine(path, schedule)
        res[name] = {"stats": train_steps(engine, local, 3), "params": full_params(engine)}
        res[name]["logprobs"] = engine.forward_logprobs(local).logprobs
        engine.close()
    res["split"] = split(2)[dp_rank]
    return res


P2T2_CASES = (("untied", "1F1B"), ("untied", "I1F1B"), ("tied", "ZBV"))  # (model, schedule) at pp=2 x tp=2


def p2t2_checks(rank: int, world_size: int, untied: str, tied: str) -> dict:
    """pp=2 x tp=2 at world 4: each stage tensor-parallel (sequence-sharded activations between
    the stages, loss-parallel head), tied weights under ZBV, export to rank 0."""
    from tests.train.tp_workers import SCHEDULE as TP_SCHEDULE

    res = {}
    for name, schedule in P2T2_CASES:
        engine = pp_engine(untied if name == "untied" else tied, schedule, tp=2, lr_schedule=TP_SCHEDULE)
        res[name, schedule] = run_case(engine, make_batch(512))
        engine.close()
    return res


# (model, schedule) at pp=2 x cp=2: each stage splits its tokens over the CP pair (Ulysses attention).
P2C2_CASES = (("untied", "1F1B"), ("untied", "I1F1B"), ("tied", "1F1B"), ("tied", "DualPipeV"))
P2C2T2_CASES = (("untied", "1F1B"), ("tied", "ZBV"))  # pp=2 x cp=2 x tp=2 (world 8)


def p2c2_checks(rank: int, world_size: int, untied: str, tied: str, tp: int = 1) -> dict:
    """pp=2 x cp=2 (x tp=2 at world 8): context-parallel pipeline stages, tied weights, export to
    rank 0."""
    from tests.train.tp_workers import SCHEDULE as TP_SCHEDULE

    res = {}
    for name, schedule in P2C2_CASES if tp == 1 else P2C2T2_CASES:
        engine = pp_engine(untied if name == "untied" else tied, schedule, cp=2, tp=tp, lr_schedule=TP_SCHEDULE)
        res[name, schedule] = run_case(engine, make_batch(512))
        engine.close()
    return res


def c2t2_checks(rank: int, world_size: int, untied: str, tied: str) -> dict:
    """cp=2 x tp=2 without a pipeline (world 4), 4 micro-batches: some give a CP slice whose token
    count is odd, which tensor parallelism pads (the slices must stay contiguous in the stream)."""
    from tests.train.tp_workers import SCHEDULE as TP_SCHEDULE

    engine = TrainEngine(engine_config(untied, mb=MicroBatchConfig(n_mbs=4), cp=2, tp=2, **TP_SCHEDULE))
    res = {("untied", "I1F1B"): run_case(engine, make_batch(512))}  # the d1 reference with 4 micro-batches
    engine.close()
    return res


# The pipeline keys' cases (tests/train/test_pipeline_keys.py): actor.parallelize options -> at pp=2.
KEY_CASES = {
    "default": {},
    "I1F1B": {"pp_schedule": "I1F1B"},
    "IZB-3": {"pp_schedule": "IZB", "pp_stages_per_rank": 3},
    "ZBV": {"pp_schedule": "ZBV"},
    "microbatches-6": {"pp_microbatches": 6},
}


def pipeline_key_checks(rank: int, world_size: int, path: str) -> dict:
    """Per case of `KEY_CASES`: the torch schedule one training step ran, this rank's stages and the
    step's micro-batch count (the batch's own plan asks for one micro-batch)."""
    import tandem.train.pipeline_step as pipeline_step

    built: list[str] = []
    real = pipeline_step.build_schedule

    def recording(*args, **kwargs):
        schedule = real(*args, **kwargs)
        built.append(type(schedule).__name__)
        return schedule

    pipeline_step.build_schedule = recording
    batch = make_batch(512)
    out = {}
    for name, options in KEY_CASES.items():
        engine = TrainEngine(engine_config(path, pp=2, parallelize=ParallelizeConfig(**options)))
        stats = train_steps(engine, batch, 1)[0]
        out[name] = (built[-1], engine.pipeline.layout.rank_stages(engine.pipeline.pp_rank), stats["n_mbs"])
        engine.close()
    return out

"""Parallel layouts side by side: training tokens/s and peak memory per rank of the engine.

    .venv/bin/python bench/parallel.py [--presets small medium] [--layouts d1 d2 t2 ...] [--steps 3]

Every layout trains the same model (an untied Qwen3 of the preset's shape, fp32) on the same
global batch (32 sequences, log-normal lengths 32..256, loss on every token) for `--steps`
optimizer steps after one warm-up step, in its own spawned gloo world on 127.0.0.1. Reported per
layout: tokens/s (global tokens of a step / the median step time), its ratio to d1 measured in
the same run, and peak memory per rank: the highest resident set (VmHWM) a rank reached while
building the engine and training, minus its resident set just before (the torch runtime itself
is not counted); the largest over the ranks. The reference is d1 (one rank, the whole model).

On this 2-core machine, layouts of 2 ranks run one thread per rank and 4-rank layouts
oversubscribe the cores: tokens/s compares what each layout costs here, not what it buys across
GPUs. Memory is the point: TP and PP split the parameters, gradients and optimizer state, and
the activations, between ranks. Appends the table to docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp
from _report import append_benchmark  # bench/ is on sys.path when run as a script
from current import record, this_command

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests.distributed import run_distributed

# layout name -> (world size, TrainEngineConfig keyword arguments)
LAYOUTS: dict[str, tuple[int, dict]] = {
    "d1": (1, {}),
    "d2": (2, {}),
    "t2": (2, {"tp": 2}),
    "p2-1F1B": (2, {"pp": 2, "schedule": "1F1B"}),
    "p2-Interleaved1F1B": (2, {"pp": 2, "schedule": "Interleaved1F1B"}),
    "p2-InterleavedZeroBubble": (2, {"pp": 2, "schedule": "InterleavedZeroBubble"}),
    "p2-ZBVZeroBubble": (2, {"pp": 2, "schedule": "ZBVZeroBubble"}),
    "c2": (2, {"cp": 2}),
    "d2t2": (4, {"tp": 2}),
    # Qwen3-MoE (--arch qwen3_moe): experts folded over the TP and CP ranks, the Archon document's
    # (attn:d1p4t2c2|ffn:d1p4t1e4) and its half-depth twin.
    "(attn:d1p2t2c2|ffn:d1p2t1e4)": (8, {"pp": 2, "tp": 2, "cp": 2, "ep": 4, "schedule": "1F1B"}),
    "(attn:d1p4t2c2|ffn:d1p4t1e4)": (16, {"pp": 4, "tp": 2, "cp": 2, "ep": 4, "schedule": "1F1B"}),
}
MOE_LAYOUTS = ("d1", "(attn:d1p2t2c2|ffn:d1p2t1e4)", "(attn:d1p4t2c2|ffn:d1p4t1e4)")
N_SEQS, MIN_LEN, MAX_LEN = 32, 32, 256


def _lengths(seed: int = 0) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    raw = torch.empty(N_SEQS).log_normal_(mean=4.5, std=0.6, generator=gen)
    return [int(x) for x in raw.clamp(MIN_LEN, MAX_LEN)]


def _rss_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def _nll(logprobs, entropy, mb):
    del entropy
    return -(logprobs * mb.tokens["loss_mask"]).sum()


def _worker(rank: int, world_size: int, path: str, layout: dict, steps: int) -> dict[str, float]:
    from tandem.data.balance import karmarkar_karp
    from tandem.parallel import ParallelizeConfig
    from tandem.train import MicroBatchConfig, SequenceBatch, TrainEngine, TrainEngineConfig
    from tandem.train.config import OptimizerConfig

    layout = dict(layout)
    schedule = layout.pop("schedule", None)
    parallelize = ParallelizeConfig(**({"pp_schedule": schedule} if schedule else {}))
    model_parallel = layout.get("tp", 1) * layout.get("pp", 1) * layout.get("cp", 1)  # ep adds no ranks
    dp = world_size // model_parallel
    vocab = int(__import__("json").loads((Path(path) / "config.json").read_text())["vocab_size"])
    gen = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, vocab, (n,), generator=gen) for n in _lengths()]
    batch = SequenceBatch([{"input_ids": s, "loss_mask": torch.ones_like(s)} for s in seqs])
    n_tokens = sum(batch.lengths)
    coords_dp = (rank // (layout.get("cp", 1) * layout.get("tp", 1))) % dp
    shard = batch.select(karmarkar_karp(batch.lengths, dp, equal_size=True)[coords_dp]) if dp > 1 else batch

    import transformers  # noqa: F401  (what the engine imports lazily, loaded before the baseline)

    import tandem.models.hf_checkpoint  # noqa: F401
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := the current resident set
    before = _rss_kib("VmRSS")
    config = TrainEngineConfig(path=path, optimizer=OptimizerConfig(lr=1e-5), parallelize=parallelize,
                               mb=MicroBatchConfig(max_tokens_per_mb=1024), **layout)
    engine = TrainEngine(config)
    engine.train_batch(shard, _nll)  # warm-up
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.train_batch(shard, _nll)
        times.append(time.perf_counter() - start)
    peak = _rss_kib("VmHWM") - before
    engine.close()
    return {"tokens_per_s": n_tokens / statistics.median(times), "peak_mib": peak / 1024}


def bench(presets: list[str], layouts: list[str], steps: int,
          arch: str = "qwen3") -> tuple[str, dict[str, dict[str, dict[str, float]]]]:
    """The table, and the results that ran: preset -> layout -> tokens_per_s, peak_mib."""
    from tandem.models.tiny import init_model

    # 4 layers at least (pp=4 needs one per stage); a MoE model keeps one dense layer among them.
    extra = {"num_hidden_layers": 4, "mlp_only_layers": [1]} if arch == "qwen3_moe" else {}

    rows = ["| preset | layout | ranks | tokens/s | vs d1 | peak memory per rank (MiB) | vs d1 |",
            "|---|---|---|---|---|---|---|"]
    results: dict[str, dict[str, dict[str, float]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for preset in presets:
            path = str(init_model(Path(tmp) / preset, arch=arch, preset=preset, seed=0,
                                  overrides={"tie_word_embeddings": False, **extra}))
            ref: dict[str, float] | None = None
            for name in layouts:
                world, layout = LAYOUTS[name]
                try:
                    per_rank = run_distributed(_worker, world, args=(path, layout, steps), timeout=900)
                except Exception as exc:  # a layout this build cannot run: say so in the table
                    print(f"{preset} {name}: failed: {str(exc).strip().splitlines()[-1][:200]}", flush=True)
                    rows.append(f"| {preset} | {name.replace('|', chr(92) + '|')} | {world} | failed | | | |")
                    continue
                result = {"tokens_per_s": per_rank[0]["tokens_per_s"], "peak_mib": max(r["peak_mib"] for r in per_rank)}
                results.setdefault(preset, {})[name] = result
                ref = ref or (result if name == "d1" else None)
                speed = f"{result['tokens_per_s'] / ref['tokens_per_s']:.2f}x" if ref else ""
                memory = f"{result['peak_mib'] / ref['peak_mib']:.2f}x" if ref else ""
                shown = name.replace("|", "\\|")  # a hybrid layout's '|' inside a markdown table
                line = (f"| {preset} | {shown} | {world} | {result['tokens_per_s']:.0f} | {speed} | "
                        f"{result['peak_mib']:.1f} | {memory} |")
                print(line, flush=True)
                rows.append(line)
    return "\n".join(rows), results


def record_current(results: dict[str, dict[str, dict[str, float]]], bench_name: str = "parallel") -> None:
    """The Current figures row of `bench_name`: the last preset's fastest layout and smallest peak
    memory against d1."""
    preset, runs = list(results.items())[-1]
    d1 = runs.get("d1")
    if d1 is None:
        return  # nothing to compare with
    fast = max(runs, key=lambda n: runs[n]["tokens_per_s"])
    small = min(runs, key=lambda n: runs[n]["peak_mib"])
    record(bench_name,
           f"{preset} {fast} {runs[fast]['tokens_per_s']:.0f} tok/s; peak memory per rank down to "
           f"{runs[small]['peak_mib']:.1f} MiB ({small})",
           f"d1 (one rank): {d1['tokens_per_s']:.0f} tok/s, {d1['peak_mib']:.1f} MiB",
           f"{runs[fast]['tokens_per_s'] / d1['tokens_per_s']:.2f}x tok/s; "
           f"{runs[small]['peak_mib'] / d1['peak_mib']:.2f}x memory", this_command())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--presets", nargs="+", default=["small", "medium"])
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--arch", choices=["qwen3", "qwen3_moe"], default="qwen3",
                        help="qwen3_moe: a 4-layer Qwen3-MoE (8 experts) under the MoE layouts (default layouts: "
                             "d1 and the folded ones)")
    parser.add_argument("--no-append", action="store_true", help="print only")
    args = parser.parse_args()
    if args.arch == "qwen3_moe" and args.layouts == list(LAYOUTS):
        args.layouts = list(MOE_LAYOUTS)
    if "d1" not in args.layouts:
        args.layouts.insert(0, "d1")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    table, results = bench(args.presets, args.layouts, args.steps, args.arch)
    print(table)
    if not args.no_append:
        model = "Qwen3-MoE (4 layers, 8 experts, top-2)" if args.arch == "qwen3_moe" else "Qwen3"
        body = (f"Untied {model} presets, fp32, {N_SEQS} sequences of {MIN_LEN}..{MAX_LEN} tokens per step, "
                f"token budget 1024 per micro-batch, median of {args.steps} steps after a warm-up, gloo, one "
                f"thread per rank. `{this_command()}`. Peak memory per rank: the highest "
                "resident set a rank reached while building the engine and training, above its resident set "
                "before (largest rank).\n\n" + table)
        append_benchmark("Parallel layouts: tokens/s and peak memory per rank", body)
        record_current(results, "parallel (MoE)" if args.arch == "qwen3_moe" else "parallel")


if __name__ == "__main__":
    mp.set_start_method("spawn", force=True)
    main()

"""DP load balancing: imbalance (max / mean part load) of each partitioner on long-tailed lengths,
and Karmarkar–Karp's time at n = 100k. Run: `.venv/bin/python bench/balance.py`; the table is
printed and appended to docs/benchmarks.md.

    .venv/bin/python bench/balance.py --train     # actor.balance=tokens vs flops in real `tandem train` runs

`--train` runs the same `tandem train` job twice, `actor.balance=tokens` then `flops`: a tiny model
(`tandem init-model`, hidden size 64, so a sequence of L tokens costs 768·L + L²), two trainer
ranks (`archon:d2`), one server, synchronous (each step's batch is the same in both runs), and the
long-tail workload of `bench/_longtail_agent.py` (one call per episode whose completion length is
log-normal). It reads each run's `dispatch/imbalance_*` metrics from metrics.jsonl and prints the
FLOP and token imbalance (max / mean over the ranks) of both runs and their ratio."""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import _longtail_agent as agent
from _report import append_benchmark
from _run import stop_tandem
from current import record, this_command

from tandem.data.balance import _ldm, greedy_partition, imbalance, karmarkar_karp

CASES = [(256, 8), (1024, 16), (4096, 64)]
SEED = 0


def lengths(n: int, seed: int) -> list[int]:
    """Log-normal sequence lengths (mu=6, sigma=1: median ~400 tokens, long tail), clipped."""
    rng = random.Random(seed)
    return [int(min(32768, max(16, rng.lognormvariate(6.0, 1.0)))) for _ in range(n)]


def round_robin(values: list[int], k: int) -> list[list[int]]:
    return [list(range(r, len(values), k)) for r in range(k)]


def median_time(fn: Callable[[], object], repeats: int = 3) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


TANDEM = str(Path(sys.executable).with_name("tandem"))
AGENT = Path(__file__).resolve().parent / "_longtail_agent.py"
TRAIN_TITLE = "balance --train: actor.balance in tandem train"
METRICS = ("imbalance_flops", "imbalance_tokens", "imbalance_naive_flops", "imbalance_naive_tokens")


def train_run(args: argparse.Namespace, model: Path, root: Path, balance: str) -> list[dict]:
    """One `tandem train` run with `actor.balance=balance`; its RL metric rows, in step order."""
    run_dir = root / "runs" / "balance" / balance
    overrides = [
        f"actor.path={model}", f"experiment.fileroot={root / 'runs'}", "experiment.name=balance",
        f"experiment.trial={balance}", "train.overwrite=true", f"actor.balance={balance}",
        "actor.backend=archon:d2", "actor.num_threads=1", "actor.mb.max_tokens_per_mb=2048",
        "rollout.backend=tandem:d1", "rollout.server_args=[--num-threads,1]",
        "rollout.max_head_offpolicyness=0", f"rollout.consumer_batch_size={args.prompts}",
        "rollout.workflow=agent", f"rollout.agent.entry={AGENT}:run",
        f"gen.n_samples={args.samples}", f"gen.max_new_tokens={agent.MAX_TOKENS}",
        "task.name=arithmetic", "task.eval_size=0", f"train.total_steps={args.steps}", "train.eval_every=0",
        "stats.progress=false", "stats.plot=false", "stats.tensorboard=false",
    ]
    log_path = root / f"{balance}.log"
    with log_path.open("w") as log:
        proc = subprocess.Popen([TANDEM, "train", *overrides], stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        try:
            proc.wait(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            stop_tandem(proc)
            raise TimeoutError(f"run {balance} took more than {args.timeout:.0f} s; see {log_path}") from None
    if proc.returncode != 0:
        raise RuntimeError(f"tandem train ({balance}) exited with {proc.returncode}:\n{log_path.read_text()[-3000:]}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rows = sorted((r for r in rows if r.get("phase") == "rl" and "dispatch/imbalance_flops" in r),
                  key=lambda r: r["step"])
    if len(rows) != args.steps:
        raise RuntimeError(f"run {balance}: {len(rows)} steps with dispatch metrics, expected {args.steps}")
    return rows


def train_main(args: argparse.Namespace) -> None:
    began = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="balance-") as tmp:
        root = Path(args.workdir or tmp).resolve()
        root.mkdir(parents=True, exist_ok=True)
        model = root / "model-tiny"
        if not (model / "config.json").is_file():
            subprocess.run([TANDEM, "init-model", str(model), "--preset", "tiny", "--seed", "0"], check=True,
                           stdout=subprocess.DEVNULL)
        hidden = json.loads((model / "config.json").read_text())["hidden_size"]
        runs = {balance: train_run(args, model, root, balance) for balance in ("tokens", "flops")}
    same = all(a["gen/response_len_mean"] == b["gen/response_len_mean"] for a, b in zip(*runs.values(), strict=True))
    mean = {b: {m: statistics.mean(r[f"dispatch/{m}"] for r in rows) for m in METRICS} for b, rows in runs.items()}
    worst = {b: max(r["dispatch/imbalance_flops"] for r in rows) for b, rows in runs.items()}
    lines = ["| run | FLOP imbalance | token imbalance | worst step's FLOP imbalance | naive split: FLOP "
             "| naive: tokens |", "|---|---:|---:|---:|---:|---:|"]
    for b in runs:
        m = mean[b]
        lines.append(f"| `actor.balance={b}` | {m['imbalance_flops']:.4f} | {m['imbalance_tokens']:.4f} | "
                     f"{worst[b]:.4f} | {m['imbalance_naive_flops']:.4f} | {m['imbalance_naive_tokens']:.4f} |")
    per_step = ", ".join(f"{a['dispatch/imbalance_flops']:.3f} / {b['dispatch/imbalance_flops']:.3f}"
                         for a, b in zip(runs["tokens"], runs["flops"], strict=True))
    ft, ff = mean["tokens"]["imbalance_flops"], mean["flops"]["imbalance_flops"]
    ratio = ff / ft
    excess = (ff - 1) / (ft - 1) if ft > 1 else float("nan")
    verdict = "below" if ff < ft else "NOT below"
    seqs = args.prompts * args.samples
    text = (
        f"`bench/balance.py --train`: the same `tandem train` job with `actor.balance=tokens` and `flops`: "
        f"a tiny random model (hidden size {hidden}: FLOP cost {12 * hidden}·L + L² per sequence), two trainer "
        f"ranks (`archon:d2`, one thread each), one server (`tandem:d1`), synchronous "
        f"(`rollout.max_head_offpolicyness=0`), {args.steps} steps of {args.prompts} prompts x {args.samples} "
        f"samples = {seqs} sequences (equal-size halves). Workload `bench/_longtail_agent.py`: each episode asks "
        f"for a completion of log-normal length (mu={agent.MU}, sigma={agent.SIGMA}, clipped to "
        f"[{agent.MIN_TOKENS}, {agent.MAX_TOKENS}], `ignore_eos`) after the arithmetic prompt; the lengths "
        f"depend only on the item and the episode's number, so both runs train the same batches "
        f"(response-length means equal at every step: {'yes' if same else 'NO'}). Imbalance = max / mean "
        f"load over the two ranks from the runs' `dispatch/imbalance_*` metrics, mean over the steps (the "
        f"model's FLOP proxy of `tandem.data.balance.sequence_cost`, not timed: at this size a step's time is "
        f"overhead).\n\n"
        + "\n".join(lines)
        + f"\n\nFLOP imbalance per step (tokens run / flops run): {per_step}.\n\n"
        f"FLOP imbalance of the FLOP-balanced run / the token-balanced run's: **{ratio:.4f}** (excess over "
        f"1.0: {excess:.2f}x); {verdict} the token-balanced run's. Benchmark took {time.monotonic() - began:.0f} s."
    )
    print(text)
    if args.no_append:
        return
    path = append_benchmark(TRAIN_TITLE, text)
    print(f"\nappended to {path}")
    record("balance --train", f"actor.balance=flops: FLOP imbalance {ff:.4f} (token imbalance "
           f"{mean['flops']['imbalance_tokens']:.4f})", f"actor.balance=tokens: FLOP imbalance {ft:.4f}",
           f"{ratio:.4f}", this_command())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--no-append", action="store_true", help="print only; leave docs/benchmarks.md alone")
    parser.add_argument("--train", action="store_true", help="compare actor.balance=tokens and flops in tandem train")
    parser.add_argument("--steps", type=int, default=20, help="--train: train.total_steps of each run")
    parser.add_argument("--prompts", type=int, default=4, help="--train: prompts per step (groups)")
    parser.add_argument("--samples", type=int, default=4, help="--train: episodes per prompt")
    parser.add_argument("--timeout", type=float, default=600, help="--train: seconds one run may take")
    parser.add_argument("--workdir", default=None, help="--train: model and runs here (default: a temporary directory)")
    args = parser.parse_args()
    if args.train:
        train_main(args)
        return
    rows = [
        "| n | k | round-robin | greedy (LPT) | KK | KK equal-size | chunked LDM | LPT equal-size "
        "| lower bound | KK / bound |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for n, k in CASES:
        values = lengths(n, SEED)
        mean = sum(values) / k
        bound = max(mean, max(values)) / mean
        kk = imbalance(values, karmarkar_karp(values, k))
        kk_eq = imbalance(values, karmarkar_karp(values, k, equal_size=True))
        cells = [
            imbalance(values, round_robin(values, k)),
            imbalance(values, greedy_partition(values, k)),
            kk,
            kk_eq,
            imbalance(values, _ldm([float(v) for v in values], k, equal_size=True)),
            imbalance(values, greedy_partition(values, k, equal_size=True)),
            bound,
        ]
        rows.append(f"| {n} | {k} | " + " | ".join(f"{c:.4f}" for c in cells) + f" | {kk / bound:.4f} |")
    table = "\n".join(rows)

    big = lengths(100_000, SEED + 1)
    big_eq = lengths(100_032, SEED + 1)  # equal_size needs n divisible by k = 64
    t_kk = median_time(lambda: karmarkar_karp(big, 64))
    t_eq = median_time(lambda: karmarkar_karp(big_eq, 64, equal_size=True))
    t_lpt = median_time(lambda: greedy_partition(big, 64))
    timing = (
        "Time, median of 3, k = 64: "
        f"KK n=100,000: {t_kk:.3f} s; KK equal-size n=100,032: {t_eq:.3f} s; "
        f"greedy (LPT) n=100,000: {t_lpt:.3f} s."
    )
    body = (
        "Imbalance = max part load / mean part load (1.0 is perfect) on log-normal lengths "
        f"(mu=6, sigma=1, clipped to [16, 32768], seed {SEED}); lower bound = max(mean, largest "
        "item) / mean. KK equal-size is what `karmarkar_karp(equal_size=True)` returns: the better of "
        "the chunked LDM (one item of each sorted k-chunk per part) and LPT with room, both shown."
        f"\n\n{table}\n\n{timing}"
    )
    print(table)
    print()
    print(timing)
    if args.no_append:
        return
    path = append_benchmark("balance", body)
    print(f"\nappended to {path}")
    n, k = CASES[-1]  # the largest case, whose figures are the loop's last
    record("balance", f"KK imbalance {kk:.4f} at n={n}, k={k} (KK equal-size {kk_eq:.4f})",
           f"lower bound {bound:.4f}", f"KK / bound {kk / bound:.4f}", this_command())


if __name__ == "__main__":
    main()

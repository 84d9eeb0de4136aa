"""DP load balancing: imbalance (max / mean part load) of each partitioner on long-tailed lengths,
and Karmarkar–Karp's time at n = 100k. Run: `.venv/bin/python bench/balance.py`; the table is
printed and appended to docs/benchmarks.md."""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable

from _report import append_benchmark
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--no-append", action="store_true", help="print only; leave docs/benchmarks.md alone")
    args = parser.parse_args()
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

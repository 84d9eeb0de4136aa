"""Sandbox throughput: executions per second of a trivial program through `SandboxPool` (workers 1
and 2), and the overhead per execution against a plain `subprocess.run([python3, "-c", "pass"])`,
measured in the same run.

Each side runs `--n` executions after `--warmup` untimed ones, in rounds that alternate the sides
(plain, pool workers=1, pool workers=2), so that drifting load on a shared machine hits all alike;
the figures are the medians over `--rounds` rounds. The plain side runs the same interpreter
(`/usr/bin/python3`) unisolated, one after another; the overhead per execution is the pool's
(workers=1) seconds per execution minus the plain side's. The sandbox uses the default limits
(`rollout.sandbox.*`), cgroups where mounted.

Run: `.venv/bin/python bench/sandbox.py` (~1 min on 2 cores); prints a table, adds a run to
docs/benchmarks.md and rewrites its Current figures row (`--no-append` to skip both)."""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

from _report import append_benchmark
from current import record, this_command

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tandem.sandbox import SandboxConfig, SandboxPool, cgroups
from tandem.sandbox.isolation import PYTHON

PROGRAM = "pass\n"


def plain_seconds(n: int) -> float:
    """Seconds per `subprocess.run([python3, -c, pass])`, one after another."""
    started = time.perf_counter()
    for _ in range(n):
        subprocess.run([PYTHON, "-c", "pass"], check=True)
    return (time.perf_counter() - started) / n


def pool_rate(pool: SandboxPool, n: int) -> float:
    """Executions per second of `n` trivial programs submitted at once."""
    started = time.perf_counter()
    results = pool.map([(PROGRAM, None)] * n)
    took = time.perf_counter() - started
    bad = [r for r in results if not r.ok]
    if bad:
        raise SystemExit(f"an execution failed: {bad[0]}")
    return n / took


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=100, help="executions per side and round")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--no-append", action="store_true", help="print only; leave docs/benchmarks.md alone")
    args = ap.parse_args()
    pools = {w: SandboxPool(SandboxConfig(workers=w)) for w in (1, 2)}
    try:
        plain_seconds(args.warmup)
        for pool in pools.values():
            pool_rate(pool, args.warmup)
        plain, rates = [], {1: [], 2: []}
        for r in range(args.rounds):
            plain.append(plain_seconds(args.n))
            for w, pool in pools.items():
                rates[w].append(pool_rate(pool, args.n))
            print(f"  round {r + 1}: plain {1 / plain[-1]:.1f}/s, workers=1 {rates[1][-1]:.1f}/s, "
                  f"workers=2 {rates[2][-1]:.1f}/s", flush=True)
    finally:
        for pool in pools.values():
            pool.close()
    plain_s = statistics.median(plain)
    rate = {w: statistics.median(v) for w, v in rates.items()}
    overhead = 1 / rate[1] - plain_s
    lines = [
        "| side | executions / s | ms per execution | vs plain |",
        "|---|---|---|---|",
        f"| plain `subprocess.run([python3, -c, pass])` | {1 / plain_s:.1f} | {1e3 * plain_s:.1f} | 1.00x |",
    ]
    for w in (1, 2):
        lines.append(f"| SandboxPool workers={w} | {rate[w]:.1f} | {1e3 / rate[w]:.1f} | "
                     f"{rate[w] * plain_s:.2f}x |")
    text = ("\n".join(lines) + f"\n\nOverhead of the sandbox per execution (workers=1 minus plain): "
            f"{1e3 * overhead:.1f} ms. Trivial program `pass`; medians of {args.rounds} rounds of {args.n} "
            f"executions per side, sides alternating; default limits; cgroups "
            f"{'v1 memory/pids/cpuacct' if cgroups.available() else 'not available'}.")
    print(text)
    if not args.no_append:
        append_benchmark("sandbox: executions per second through the pool (issue 47)", text)
        record("sandbox", f"{rate[1]:.1f} executions/s (workers=1), {rate[2]:.1f} (workers=2); "
                          f"overhead {1e3 * overhead:.1f} ms per execution",
               f"plain subprocess.run(python3 -c pass) {1 / plain_s:.1f}/s",
               f"{rate[1] * plain_s:.2f}x / {rate[2] * plain_s:.2f}x", this_command())


if __name__ == "__main__":
    main()

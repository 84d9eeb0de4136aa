"""An elastic fleet under faults: one `tandem train` job with three launched servers; one is killed
(SIGKILL) at step 10 and a new server joins (`tandem serve --join`) at step 20.

    .venv/bin/python bench/elastic.py            # ~5 minutes; appends to docs/benchmarks.md
    .venv/bin/python bench/elastic.py --quick    # smoke run, prints only

Measured, all in the same run:
- time to detect: from the kill to the server's `evicted` state in what `tandem fleet --json`
  shows (asked every 50 ms). A launched server is evicted when the launcher sees its process exit; the health
  monitor's own bound (interval x threshold + timeout) is printed beside it.
- time to rejoin: from starting `tandem serve --join` to `healthy` (model load, registration,
  warm-up from disk with checksums, the cooldown, admission at the next update), and from its
  registration (`joining`) to `healthy`.
- trained samples/s before the kill (the reference), between the kill and the join, and after the
  joiner is healthy, from the rows' wall-clock stamps; each as a ratio to the reference.
- samples lost: `rollout/lost_total` of the last row (must be 0), and the resubmissions.

On a 2-core machine three servers and a trainer already oversubscribe the cores, so losing a
server can make the run faster and a joiner slower: the ratios say what the fleet does to
throughput on this machine, not what more servers buy on real hardware.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _fleet import fleet, rows, start_joiner  # bench/ is on sys.path when run as a script
from _report import append_benchmark
from current import record, this_command

TANDEM = str(Path(sys.executable).with_name("tandem"))


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="small", choices=["tiny", "small", "medium"])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--kill-at", type=int, default=10)
    p.add_argument("--join-at", type=int, default=20)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--quick", action="store_true", help="12 steps, kill at 3, join at 6; prints only")
    p.add_argument("--no-append", action="store_true")
    args = p.parse_args()
    if args.quick:
        args.steps, args.kill_at, args.join_at, args.no_append = 12, 3, 6, True
    return args


def rate(window: list[dict], samples_per_step: int) -> float:
    """Trained samples/s over consecutive rows (their write times)."""
    if len(window) < 2:
        return float("nan")
    return samples_per_step * (len(window) - 1) / (window[-1]["time"] - window[0]["time"])


def main() -> None:
    args = parse_args()
    work = Path(tempfile.mkdtemp(prefix="tandem-elastic-"))
    model = work / "model"
    subprocess.run([TANDEM, "init-model", str(model), "--preset", args.preset], check=True, capture_output=True)
    run = work / "runs" / "elastic" / "t"
    prompts, samples = 4, 4
    overrides = [
        f"actor.path={model}", f"experiment.fileroot={work / 'runs'}", "experiment.name=elastic", "experiment.trial=t",
        "actor.backend=archon:d1", "rollout.backend=tandem:d3", "rollout.server_args=[--num-threads,1]",
        f"rollout.consumer_batch_size={prompts}", f"gen.n_samples={samples}", f"gen.max_new_tokens={args.max_new_tokens}",
        f"train.total_steps={args.steps}", "train.eval_every=0", "task.eval_size=8", "stats.progress=false",
        "rollout.health.interval_s=1", "rollout.health.timeout_s=1", "rollout.topology_cooldown_s=5",
    ]
    proc = subprocess.Popen([TANDEM, "train", "examples/demo.yaml", *overrides], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    deadline = time.monotonic() + args.timeout
    killed_at = detected = join_started = joined = registered = joined_wall = None
    victim = joiner = None
    joiner_proc = None
    try:
        while proc.poll() is None and time.monotonic() < deadline:
            done = len(rows(run))
            if killed_at is None and done >= args.kill_at:
                listed = fleet(run)
                victim = listed[1]
                os.kill(victim["pid"], signal.SIGKILL)
                killed_at = time.monotonic()
            if killed_at is not None and detected is None and any(
                    s["address"] == victim["address"] and s["state"] == "evicted" for s in fleet(run)):
                detected = time.monotonic() - killed_at
            if join_started is None and done >= args.join_at:
                join_started = time.monotonic()
                joiner_proc, joiner = start_joiner([TANDEM], model, run)
            if joiner and joined is None:
                states = {s["address"]: s["state"] for s in fleet(run)}
                if states.get(joiner) is not None and registered is None:
                    registered = time.monotonic()
                if states.get(joiner) == "healthy":
                    joined, joined_wall = time.monotonic(), time.time()
            time.sleep(0.05)
        _, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        if joiner_proc is not None:
            joiner_proc.terminate()
            joiner_proc.wait(30)
    if proc.returncode != 0:
        raise SystemExit(f"the run failed ({proc.returncode}):\n{err[-3000:]}")
    all_rows = rows(run)
    per_step = prompts * samples
    kill_step = args.kill_at
    # The first row written after the joiner became healthy starts the "after" window.
    join_step = next((r["step"] for r in all_rows if joined_wall is not None and r["time"] >= joined_wall),
                     args.steps)
    before = [r for r in all_rows if 2 <= r["step"] <= kill_step]
    during = [r for r in all_rows if kill_step <= r["step"] <= args.join_at]
    after = [r for r in all_rows if join_step <= r["step"] < args.steps]  # the last row waits for the final eval
    ref = rate(before, per_step)
    last = all_rows[-1]
    bound = 1 * 3 + 1
    lines = [
        f"3 launched servers ({args.preset}, one thread each), 1 trainer rank, {prompts}x{samples} samples of "
        f"{args.max_new_tokens} tokens per step, {args.steps} steps; kill -9 one server at step {kill_step}, "
        f"`tandem serve --join` at step {args.join_at}. `.venv/bin/python bench/elastic.py`.",
        "",
        "| measure | value |",
        "|---|---|",
        f"| time to detect the kill (launcher; monitor bound {bound} s) | {detected:.2f} s |" if detected is not None
        else "| time to detect the kill | not seen |",
        f"| time to rejoin, from starting the joiner | {joined - join_started:.1f} s |" if joined and join_started
        else "| time to rejoin | not within the run |",
        f"| time to rejoin, from its registration | {joined - registered:.1f} s |" if joined and registered
        else "| time to rejoin, from its registration | not within the run |",
        f"| trained samples/s before the kill (reference) | {ref:.2f} |",
        f"| trained samples/s with 2 servers | {rate(during, per_step):.2f} ({rate(during, per_step) / ref:.2f}x) |",
        f"| trained samples/s after the join (steps {join_step}-{args.steps - 1}) | {rate(after, per_step):.2f} "
        f"({rate(after, per_step) / ref:.2f}x) |",
        f"| samples lost (rollout/lost_total) | {int(last['rollout/lost_total'])} |",
        f"| generation calls resubmitted | {int(last['rollout/resubmitted_total'])} |",
        f"| servers healthy at the end / evicted / joined | {int(last['fleet/healthy'])} / "
        f"{int(last['fleet/evicted_total'])} / {int(last['fleet/joined_total'])} |",
    ]
    body = "\n".join(lines)
    print(body)
    if not args.no_append:
        append_benchmark("Elastic fleet: kill one of three servers, join one", body)
        detect = f"kill detected in {detected:.2f} s" if detected is not None else "kill not seen"
        rejoin = (f"rejoined {joined - registered:.1f} s after registration ({joined - join_started:.1f} s after start)"
                  if joined and registered and join_started else "no rejoin within the run")
        record("elastic", f"{detect}; {rejoin}; {int(last['rollout/lost_total'])} samples lost",
               f"none (the monitor's bound: {bound} s)", "", this_command())


if __name__ == "__main__":
    main()

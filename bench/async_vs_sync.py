"""Asynchronous vs synchronous RL: trained samples/s of the same `tandem train` job at staleness 0 and 2.

    .venv/bin/python bench/async_vs_sync.py            # the real run (~10 minutes), appends to docs/benchmarks.md
    .venv/bin/python bench/async_vs_sync.py --quick    # smoke run (~2 minutes), prints only

Both runs are the same job launched as `tandem train` subprocesses with config overrides, one
inference server pinned to core 0 (`rollout.cpus=0`, `tandem:d1`, one torch thread) and one trainer
rank pinned to core 1 (`actor.cpus=1`, `archon:d1`, one torch thread); the controller process is not
pinned. Only `rollout.max_head_offpolicyness` differs: 0 (synchronous: the fleet generates batch v+1
only after weights v+1 arrive, so generation and training alternate) and 2 (asynchronous: the fleet
runs up to two batches ahead while the trainer trains).

Trained samples/s = sequences consumed by the trainer per second of steady-state wall time, start-up
and the first `--skip` steps excluded. Two measures of that wall time, both printed:
- step sums: the sum of a run's `time/generation + time/train + time/sync` over steps skip+1..N,
  from metrics.jsonl (the loop's own timers; they cover everything in a step but the metrics write);
- wall clock: this script polls metrics.jsonl every 20 ms and stamps each row when it appears; the
  time from row `skip` to row N-1 (row N is written after the final evaluation, so it is left out).
While a run is in its window the script also reads the CPU time of each process of the run
(/proc/PID/stat), so the table says how busy the server's core, the trainer's core and the
controller were: the overlap async buys is visible there directly.

The runs alternate (sync, async, async, sync, ...) so drift in the load of a shared machine hits
both modes alike; the table shows the median over repeats and the ratio of medians.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from _report import append_benchmark  # bench/ is on sys.path when run as a script
from _run import stop_tandem
from current import record, this_command

TANDEM = str(Path(sys.executable).with_name("tandem"))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    a = p.add_argument
    a("--preset", default="small", choices=["tiny", "small", "medium"])
    a("--prompts", type=int, default=2, help="prompts per training batch (rollout.consumer_batch_size)")
    a("--samples", type=int, default=8, help="samples per prompt (gen.n_samples)")
    a("--max-new-tokens", type=int, default=384)
    a("--mb-tokens", type=int, default=512, help="actor.mb.max_tokens_per_mb")
    a("--steps", type=int, default=10, help="train.total_steps of each run")
    a("--skip", type=int, default=2, help="steps left out of the steady-state window (warm-up)")
    a("--staleness", type=int, default=2, help="max_head_offpolicyness of the asynchronous run")
    a("--repeats", type=int, default=3, help="runs of each mode, alternated")
    a("--workdir", default=None, help="model and run directories (default: a temporary directory)")
    a("--timeout", type=float, default=600, help="seconds one run may take")
    a("--quick", action="store_true", help="smoke run: 64 new tokens, 5 steps, 1 repeat, nothing appended")
    a("--no-append", action="store_true", help="print only; leave docs/benchmarks.md alone")
    a("overrides", nargs="*", help="extra key=value overrides for both runs")
    args = p.parse_args(argv)
    if args.quick:
        args.max_new_tokens, args.steps, args.skip, args.repeats, args.no_append = 64, 5, 1, 1, True
    if args.steps < args.skip + 3:
        p.error("--steps must be at least --skip + 3 (the wall-clock window needs two rows before the last)")
    return args


# ---------------------------------------------------------------- processes and their CPU time


def _children() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        kids.setdefault(ppid, []).append(int(entry))
    return kids


def _tree(root: int) -> list[int]:
    kids, out, todo = _children(), [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(kids.get(pid, []))
    return out


def _role(pid: int, root: int) -> str | None:
    if pid == root:
        return "controller"
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
    except OSError:
        return None
    if b"tandem.launch.guard" in cmd:
        return None  # a waiting parent of the real child
    if b"tandem.cli serve" in cmd:
        return "server"
    if b"tandem.train.worker" in cmd:
        return "trainer"
    return "other"


def usage_by_role(root: int) -> dict[str, float]:
    """Per role, summed over the live processes of the run: `ROLE` = CPU seconds so far (all
    threads), `ROLE_wait` = seconds the busiest thread of each process (the one computing) spent
    runnable but waiting for a core, the scheduler's run-queue delay from
    /proc/PID/task/TID/schedstat: time lost to other processes on the same core."""
    out: dict[str, float] = {}
    for pid in _tree(root):
        role = _role(pid, root)
        if role is None:
            continue
        try:
            tasks = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        per_thread = []
        for tid in tasks:
            try:
                run_ns, wait_ns = map(int, Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split()[:2])
            except (OSError, ValueError):
                continue
            per_thread.append((run_ns, wait_ns))
        if not per_thread:
            continue
        out[role] = out.get(role, 0.0) + sum(r for r, _ in per_thread) / 1e9
        out[f"{role}_wait"] = out.get(f"{role}_wait", 0.0) + max(per_thread)[1] / 1e9
    return out


# ---------------------------------------------------------------- one run


@dataclass
class RunResult:
    staleness: int
    rows: list[dict]  # rl rows with a step > 0, in order
    stamps: dict[int, float]  # step -> monotonic time its row appeared
    cpu: dict[int, dict[str, float]]  # step -> CPU seconds per role when its row appeared
    wall: float
    samples_per_step: int
    skip: int
    load: float  # mean 1-minute load average sampled at each row of the window
    derived: dict[str, float] = field(default_factory=dict)

    def window(self) -> list[dict]:
        return [r for r in self.rows if r["step"] > self.skip]

    def compute(self) -> None:
        rows = self.window()
        if any(r.get("train/skipped") for r in rows):
            raise RuntimeError("a step skipped its update (everything filtered); the samples count would be wrong")
        n = len(rows)
        gen = sum(r["time/generation"] for r in rows)
        train = sum(r["time/train"] for r in rows)
        sync = sum(r["time/sync"] for r in rows)
        last = max(self.stamps)
        first, end = self.skip, last - 1  # row `last` comes after the final evaluation
        wall = self.stamps[end] - self.stamps[first]
        steps_wall = end - first
        cpu0, cpu1 = self.cpu[first], self.cpu[end]
        self.derived = {
            "steps": n,
            "s_per_step": (gen + train + sync) / n,
            "samples_per_s": self.samples_per_step * n / (gen + train + sync),
            "wall_samples_per_s": self.samples_per_step * steps_wall / wall,
            "gen": gen / n,
            "train": train / n,
            "sync": sync / n,
            "staleness": statistics.mean(r.get("staleness/mean", 0.0) for r in rows),
            **{f"busy_{role}": (cpu1.get(role, 0.0) - cpu0.get(role, 0.0)) / wall
               for role in ("server", "trainer", "controller")},
            **{f"cpu_{role}": (cpu1.get(role, 0.0) - cpu0.get(role, 0.0)) / steps_wall
               for role in ("server", "trainer", "controller")},
            **{f"wait_{role}": (cpu1.get(f"{role}_wait", 0.0) - cpu0.get(f"{role}_wait", 0.0)) / steps_wall
               for role in ("server", "trainer", "controller")},
        }
        d = self.derived
        # Time lost to other processes on the critical path: at staleness 0 the server's and the
        # trainer's turns are serial, so both waits add to the step; when the batch is always ready
        # (async, trainer-bound) the step is the trainer's turn, and only its wait does.
        lost = d["wait_trainer"] + (d["wait_server"] if self.staleness == 0 or d["gen"] > 0.05 * d["s_per_step"] else 0.0)
        d["adj_s_per_step"] = d["s_per_step"] - lost
        d["adj_samples_per_s"] = self.samples_per_step / d["adj_s_per_step"]


def run_train(args: argparse.Namespace, model: Path, root: Path, staleness: int, trial: str) -> RunResult:
    run_dir = root / "runs" / "async_vs_sync" / trial
    shutil.rmtree(run_dir, ignore_errors=True)  # metrics.jsonl is appended to: start from nothing
    overrides = [
        f"actor.path={model}",
        f"experiment.fileroot={root / 'runs'}",
        "experiment.name=async_vs_sync",
        f"experiment.trial={trial}",
        f"rollout.max_head_offpolicyness={staleness}",
        "rollout.backend=tandem:d1",
        "actor.backend=archon:d1",
        "rollout.cpus=0",
        "actor.cpus=1",
        "rollout.server_args=[--num-threads,1]",
        "actor.num_threads=1",
        f"rollout.consumer_batch_size={args.prompts}",
        f"gen.n_samples={args.samples}",
        f"gen.max_new_tokens={args.max_new_tokens}",
        f"actor.mb.max_tokens_per_mb={args.mb_tokens}",
        "actor.optimizer.lr=1e-4",
        "task.name=arithmetic",
        "task.options={difficulty: add2, instruction: false}",
        "task.eval_size=4",
        f"train.total_steps={args.steps}",
        "train.eval_every=0",
        "stats.progress=false",
        "stats.plot=false",
        "stats.tensorboard=false",
        *args.overrides,
    ]
    metrics = run_dir / "metrics.jsonl"
    log_path = root / f"{trial}.log"
    stamps: dict[int, float] = {}
    cpu: dict[int, dict[str, float]] = {}
    loads: dict[int, float] = {}
    start = time.monotonic()
    with log_path.open("w") as log:
        proc = subprocess.Popen([TANDEM, "train", *overrides], stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        try:
            seen = 0
            while True:
                done = proc.poll() is not None
                if metrics.is_file():
                    lines = metrics.read_text().splitlines()
                    if len(lines) > seen:
                        now, usage = time.monotonic(), (usage_by_role(proc.pid) if not done else {})
                        for line in lines[seen:]:
                            row = json.loads(line)
                            if row.get("phase") == "rl" and row["step"] > 0:
                                stamps[row["step"]], cpu[row["step"]] = now, usage
                                loads[row["step"]] = os.getloadavg()[0]
                        seen = len(lines)
                if done:
                    break
                if time.monotonic() - start > args.timeout:
                    raise TimeoutError(f"run {trial} took more than {args.timeout:.0f} s; see {log_path}")
                time.sleep(0.02)  # bounded by the timeout above
        finally:
            if proc.poll() is None:
                stop_tandem(proc)
    if proc.returncode != 0:
        tail = log_path.read_text()[-3000:]
        raise RuntimeError(f"tandem train ({trial}) exited with {proc.returncode}:\n{tail}")
    rows = [r for r in map(json.loads, metrics.read_text().splitlines()) if r.get("phase") == "rl" and r["step"] > 0]
    window_loads = [v for k, v in loads.items() if k > args.skip] or [os.getloadavg()[0]]
    result = RunResult(staleness, rows, stamps, cpu, time.monotonic() - start, args.prompts * args.samples,
                       args.skip, statistics.mean(window_loads))
    result.compute()
    return result


# ---------------------------------------------------------------- report


def median_of(results: list[RunResult], key: str) -> float:
    return statistics.median(r.derived[key] for r in results)


def table(runs: dict[int, list[RunResult]], async_staleness: int) -> tuple[str, float, float]:
    cols = [
        ("trained samples/s (step sums)", "samples_per_s", "{:.2f}"),
        ("trained samples/s (wall clock)", "wall_samples_per_s", "{:.2f}"),
        ("trained samples/s without run-queue wait (estimate)", "adj_samples_per_s", "{:.2f}"),
        ("s/step", "s_per_step", "{:.2f}"),
        ("wait for batch s/step", "gen", "{:.2f}"),
        ("train s/step", "train", "{:.2f}"),
        ("sync s/step", "sync", "{:.2f}"),
        ("staleness (mean)", "staleness", "{:.2f}"),
        ("server core busy", "busy_server", "{:.0%}"),
        ("trainer core busy", "busy_trainer", "{:.0%}"),
        ("controller CPU", "busy_controller", "{:.0%}"),
        ("server CPU s/step", "cpu_server", "{:.2f}"),
        ("trainer CPU s/step", "cpu_trainer", "{:.2f}"),
        ("controller CPU s/step", "cpu_controller", "{:.2f}"),
        ("server run-queue wait s/step", "wait_server", "{:.2f}"),
        ("trainer run-queue wait s/step", "wait_trainer", "{:.2f}"),
    ]
    sync, asyn = runs[0], runs[async_staleness]
    lines = ["| | " + " | ".join(f"staleness {s}" for s in (0, async_staleness)) + " | ratio |", "|---|---:|---:|---:|"]
    for name, key, fmt in cols:
        a, b = median_of(sync, key), median_of(asyn, key)
        ratio = f"{b / a:.2f}x" if key in ("samples_per_s", "wall_samples_per_s", "adj_samples_per_s") and a else ""
        lines.append(f"| {name} | {fmt.format(a)} | {fmt.format(b)} | {ratio} |")
    each = ", ".join(
        f"staleness {s}: " + " / ".join(f"{r.derived['samples_per_s']:.2f}" for r in rs) for s, rs in runs.items()
    )
    lines.append("")
    lines.append(f"Per run (trained samples/s, step sums, in run order within a mode): {each}.")
    ratio = median_of(asyn, "samples_per_s") / median_of(sync, "samples_per_s")
    wall_ratio = median_of(asyn, "wall_samples_per_s") / median_of(sync, "wall_samples_per_s")
    adj_ratio = median_of(asyn, "adj_samples_per_s") / median_of(sync, "adj_samples_per_s")
    return "\n".join(lines), ratio, wall_ratio, adj_ratio


def split_line(sync: list[RunResult]) -> str:
    """The synchronous run's generation / training split and the ceiling it puts on overlap."""
    g, t, s = (median_of(sync, k) for k in ("gen", "train", "sync"))
    # Async: the server's path per step is generation plus the pause of the weight update, the
    # trainer's is training plus the update; the step can be no shorter than the longer path.
    ceiling = (g + t + s) / max(g + s, t + s)
    return (f"Split measured at staleness 0: generation {g:.2f} s, training {t:.2f} s, weight sync {s:.2f} s "
            f"per step (generation = {g / (t + s):.2f} x training + sync); perfect overlap would give "
            f"{ceiling:.2f}x.")


def main() -> None:
    args = parse_args()
    with tempfile.TemporaryDirectory(prefix="async_vs_sync-") as tmp:
        root = Path(args.workdir or tmp).resolve()
        root.mkdir(parents=True, exist_ok=True)
        model = root / f"model-{args.preset}"
        if not (model / "config.json").is_file():
            subprocess.run([TANDEM, "init-model", str(model), "--preset", args.preset, "--seed", "0"], check=True,
                           stdout=subprocess.DEVNULL)
        order = []
        for rep in range(args.repeats):  # ABBA: sync, async, async, sync, ...
            pair = [0, args.staleness] if rep % 2 == 0 else [args.staleness, 0]
            order.extend((s, rep) for s in pair)
        runs: dict[int, list[RunResult]] = {0: [], args.staleness: []}
        t0 = time.monotonic()
        for staleness, rep in order:
            res = run_train(args, model, root, staleness, f"s{staleness}-r{rep}")
            runs[staleness].append(res)
            d = res.derived
            print(f"staleness {staleness} run {rep}: {d['samples_per_s']:.2f} samples/s (step sums), "
                  f"{d['wall_samples_per_s']:.2f} (wall clock); per step gen {d['gen']:.2f} s, train "
                  f"{d['train']:.2f} s, sync {d['sync']:.2f} s; busy server {d['busy_server']:.0%} trainer "
                  f"{d['busy_trainer']:.0%} controller {d['busy_controller']:.0%}; run took {res.wall:.0f} s",
                  flush=True)
        body_table, ratio, wall_ratio, adj_ratio = table(runs, args.staleness)
    verdict = "meets" if ratio >= 1.6 else "misses"
    loads = {st: statistics.mean(r.load for r in rs) for st, rs in runs.items()}
    text = (
        f"`bench/async_vs_sync.py`: the same `tandem train` job at `rollout.max_head_offpolicyness` 0 and "
        f"{args.staleness}: preset {args.preset} (random init), arithmetic add2 without the instruction "
        f"sentence (23-token prompts), {args.prompts} prompts x {args.samples} samples x {args.max_new_tokens} "
        f"new tokens per step (= {args.prompts * args.samples} trained samples), fp32, "
        f"`actor.mb.max_tokens_per_mb={args.mb_tokens}`; one server (`tandem:d1`, `--num-threads 1`, "
        f"`rollout.cpus=0`), one trainer rank (`archon:d1`, `actor.num_threads=1`, `actor.cpus=1`), "
        f"controller unpinned. {args.steps} steps per run, steps 1-{args.skip} excluded; median of "
        f"{args.repeats} runs per mode, alternated. \"Busy\" = CPU seconds of that role's processes / "
        f"wall seconds over the window (1 core = 100%); run-queue wait = seconds per step the computing "
        f"thread was ready to run but another process held its core; \"without run-queue wait\" "
        f"subtracts that wait on the critical path (both turns at staleness 0, the trainer's when the "
        f"batch is always ready) — an estimate of the same job on an unshared 2-core machine.\n\n"
        f"{body_table}\n\n{split_line(runs[0])}\n\n"
        f"Ratio (async / sync trained samples/s): **{ratio:.2f}x** by step sums, {wall_ratio:.2f}x by wall "
        f"clock, {adj_ratio:.2f}x without run-queue wait; target >= 1.6x: {verdict} (measured). "
        f"Mean 1-minute load average during the runs: {loads[0]:.1f} at staleness 0, "
        f"{loads[args.staleness]:.1f} at staleness {args.staleness} (our 2-3 busy processes included)."
    )
    print("\n" + text)
    print(f"\nbenchmark took {time.monotonic() - t0:.0f} s")
    if not args.no_append:
        path = append_benchmark("Async vs sync RL (trained samples/s)", text)
        print(f"appended to {path}")
        sync, asyn = (median_of(runs[s], "samples_per_s") for s in (0, args.staleness))
        record("async_vs_sync", f"{asyn:.2f} trained samples/s at staleness {args.staleness}",
               f"{sync:.2f} at staleness 0 (sync)", f"{ratio:.2f}x", this_command())


if __name__ == "__main__":
    main()

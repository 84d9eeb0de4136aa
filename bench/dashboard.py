"""What recording a run for `tandem dashboard` costs (issue 50: under 2% of step time).

The demo's RL job (examples/demo.yaml: two servers, two trainer ranks, 8 prompts x 16 samples a
step, asynchronous) on the `--preset` model (tiny), `--max-new-tokens` (8), `--steps` steps, run twice in the same invocation: with
`dashboard.enabled=true` (the defaults: 16 trajectories kept a step, the fleet every 2 s; with
`--trainer-logprobs`, the kept ones scored on the trainer too) and with it off, alternating `--pairs` times. Figures:
- the recording's own share of each step: `time/dashboard` (what the training loop spends: the
  trainer's forward of the kept sequences, and queuing the rest for the recorder's writer thread)
  over the step's wall time (between consecutive metrics rows), steps
  after the first (the first also pays the trainer's first no-grad forward, reported apart);
- the step time with the recording over the step time without it (median of steps after the first).

    .venv/bin/python bench/dashboard.py [--steps 20] [--pairs 2] [--preset tiny] [--max-new-tokens 8] [--no-report]
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from _report import append_benchmark
from current import record, this_command

ROOT = Path(__file__).resolve().parent.parent
TANDEM = str(Path(sys.executable).with_name("tandem"))


def run(model: Path, root: Path, name: str, steps: int, enabled: bool, tokens: int, scored: bool) -> list[dict]:
    cmd = [TANDEM, "train", str(ROOT / "examples/demo.yaml"), f"actor.path={model}", f"experiment.fileroot={root}",
           f"gen.max_new_tokens={tokens}",
           f"experiment.trial={name}", f"train.total_steps={steps}", "train.eval_every=0", "task.eval_size=8",
           "train.overwrite=true", "stats.progress=false", "stats.plot=false", "stats.tensorboard=false",
           f"dashboard.enabled={str(enabled).lower()}", f"dashboard.trainer_logprobs={str(scored).lower()}"]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, timeout=1800)
    rows = [json.loads(line) for line in (root / "demo" / name / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r["phase"] == "rl" and r["step"] > 0]


def step_seconds(rows: list[dict]) -> list[float]:
    """Wall time of each step after the first (between consecutive rows)."""
    return [b["time"] - a["time"] for a, b in itertools.pairwise(rows)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--pairs", type=int, default=2)
    ap.add_argument("--preset", default="tiny", help="the model's size preset (tandem init-model)")
    ap.add_argument("--max-new-tokens", type=int, default=8, help="gen.max_new_tokens (the demo's: 8)")
    ap.add_argument("--trainer-logprobs", action="store_true",
                    help="with dashboard.trainer_logprobs=true (the kept sequences scored on the trainer)")
    ap.add_argument("--no-report", action="store_true")
    a = ap.parse_args()
    from tandem.models.tiny import init_model

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model = init_model(root / "model", preset=a.preset, seed=0)
        on_steps, off_steps, shares, scoring, firsts = [], [], [], [], []
        for pair in range(a.pairs):
            for enabled in (True, False):
                rows = run(model, root / "runs", f"{'on' if enabled else 'off'}{pair}", a.steps, enabled,
                           a.max_new_tokens, a.trainer_logprobs)
                seconds = step_seconds(rows)
                (on_steps if enabled else off_steps).extend(seconds)
                if enabled:
                    firsts.append(rows[0]["time/dashboard_score"])
                    shares.extend(r["time/dashboard"] / s for r, s in zip(rows[1:], seconds, strict=True))
                    scoring.extend(r["time/dashboard_score"] / s for r, s in zip(rows[1:], seconds, strict=True))
                print(f"pair {pair}, dashboard {'on ' if enabled else 'off'}: median step "
                      f"{statistics.median(seconds):.3f} s", flush=True)
    share = 100 * statistics.median(shares)
    on, off = statistics.median(on_steps), statistics.median(off_steps)
    lines = [
        f"`{this_command()}`: examples/demo.yaml on the {a.preset} preset (2 servers, 2 trainer ranks, 128 "
        f"sequences a step, up to {a.max_new_tokens} new tokens each), dashboard.trainer_logprobs="
        f"{str(a.trainer_logprobs).lower()}, {a.steps} steps, {a.pairs} runs with the dashboard's recording and {a.pairs} without, alternating.",
        "",
        "| | median | p90 |",
        "|---|---|---|",
        f"| recording's share of a step (time/dashboard / step) | {share:.2f}% | "
        f"{100 * sorted(shares)[int(0.9 * (len(shares) - 1))]:.2f}% |",
        f"| of which the trainer's forward of the kept sequences | {100 * statistics.median(scoring):.2f}% | |",
        f"| step with recording | {on:.3f} s | |",
        f"| step without | {off:.3f} s | |",
        f"| ratio with / without | {on / off:.3f} | |",
    ]
    if a.trainer_logprobs:
        lines += ["", f"The first step's trainer scoring (its first no-grad forward): {statistics.median(firsts):.2f} s."]
    body = "\n".join(lines)
    print(body)
    if not a.no_report:
        append_benchmark("Dashboard recording cost", body)
    if not a.no_report and not a.trainer_logprobs and a.preset == "tiny":  # the defaults: the current figure
        record("dashboard", f"recording {share:.2f}% of a step", f"step without: {off:.3f} s",
               f"{on / off:.3f}", this_command())


if __name__ == "__main__":
    main()

"""On-policy distillation vs GRPO from the same start: steps and wall time to an eval accuracy.

The start is the demo's flawed warm start (the tiny model, 2 blocks, after SFT on a teacher that
drops the last term of the sum 60% of the time; `make demo`'s first half). The teacher is the tiny
preset with 4 blocks (the same tokenizer) after a longer SFT on correct answers. From the same
student checkpoint, two `tandem train` runs of `--steps` steps, evaluated every `--eval-every`
steps on the same 200 held-out problems (greedy):

- GRPO: examples/demo.yaml (the exact reward, 8 prompts x 16 samples, staleness 1);
- distill: examples/distill.yaml (the same sampling and loop; each token's advantage is
  logp_teacher - logp_student, the outcome reward unused).

Reported per side: the first eval step whose accuracy reaches `--threshold`, the wall seconds from
the run's first evaluation to that one (evaluations included on both sides), and the last accuracy;
the ratio is GRPO's steps (and seconds) over distillation's. The models are made in `--dir` and
reused when present (`--fresh` remakes them).

Run: `.venv/bin/python bench/distill.py` (~6 min on 2 cores); prints a table, adds a run to
docs/benchmarks.md and rewrites its Current figures row (`--no-append` to skip both)."""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

from _report import append_benchmark
from current import record, this_command

REPO = Path(__file__).resolve().parent.parent
TANDEM = str(Path(sys.executable).with_name("tandem"))
SFT_LR = ["actor.optimizer.lr=3e-3", "actor.optimizer.lr_scheduler=cosine",
          "actor.optimizer.warmup_steps_proportion=0.05"]  # the Makefile's warm start


def sh(*cmd: str) -> str:
    """Run a tandem command from the repository; its stdout, or exit naming it with its stderr's end."""
    proc = subprocess.run(list(cmd), cwd=REPO, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return proc.stdout


def sft_accuracy(stdout: str) -> float:
    found = re.findall(r"eval accuracy:? ([\d.]+)(?: -> ([\d.]+))?", stdout)  # `tandem sft`: "...; eval accuracy 0.145"
    if not found:
        raise SystemExit(f"no eval accuracy in the SFT output:\n{stdout[-2000:]}")
    before, after = found[-1]
    return float(after or before)


def make_models(root: Path, teacher_steps: int, fresh: bool) -> tuple[Path, Path, float, float]:
    """(student, teacher, the student's and the teacher's eval accuracy after SFT)."""
    done = root / "accuracy.json"
    if fresh and root.exists():
        shutil.rmtree(root)
    if done.is_file():
        acc = json.loads(done.read_text())
        return root / "student/sft", root / "teacher/sft", acc["student"], acc["teacher"]
    common = ["experiment.fileroot=" + str(root / "runs"), "experiment.name=sft"]
    sh(TANDEM, "init-model", str(root / "student/base"), "--preset", "tiny", "--seed", "0", "--overwrite")
    student = sft_accuracy(sh(TANDEM, "sft", "examples/demo.yaml", f"actor.path={root / 'student/base'}",
                              f"sft.output={root / 'student/sft'}", *common, "experiment.trial=student", *SFT_LR))
    sh(TANDEM, "init-model", str(root / "teacher/base"), "--preset", "tiny", "--layers", "4", "--seed", "0",
       "--overwrite")
    teacher = sft_accuracy(sh(TANDEM, "sft", "examples/demo.yaml", f"actor.path={root / 'teacher/base'}",
                              f"sft.output={root / 'teacher/sft'}", *common, "experiment.trial=teacher",
                              "task.options.teacher_slip=0", f"sft.steps={teacher_steps}", *SFT_LR))
    done.write_text(json.dumps({"student": student, "teacher": teacher}))
    return root / "student/sft", root / "teacher/sft", student, teacher


def train(config: str, trial: str, root: Path, student: Path, steps: int, eval_every: int,
          *extra: str) -> list[tuple[int, float, float]]:
    """(step, eval accuracy, wall seconds since the first evaluation) of each evaluation."""
    sh(TANDEM, "train", config, f"actor.path={student}", f"experiment.fileroot={root / 'runs'}",
       "experiment.name=bench", f"experiment.trial={trial}", f"train.total_steps={steps}",
       f"train.eval_every={eval_every}", "train.overwrite=true", "stats.progress=false", "stats.plot=false", *extra)
    rows = [json.loads(line) for line in (root / "runs/bench" / trial / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in rows if r.get("phase") == "rl" and "eval/accuracy" in r]
    start = evals[0]["time"]
    return [(r["step"], r["eval/accuracy"], r["time"] - start) for r in evals]


def reach(evals: list[tuple[int, float, float]], threshold: float) -> tuple[int, float] | None:
    return next(((step, wall) for step, acc, wall in evals if acc >= threshold), None)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", type=Path, default=REPO / "runs" / "bench-distill")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--eval-every", type=int, default=10)
    ap.add_argument("--threshold", type=float, default=0.6)
    ap.add_argument("--teacher-steps", type=int, default=1600)
    ap.add_argument("--fresh", action="store_true", help="remake the student and teacher")
    ap.add_argument("--no-append", action="store_true", help="print only; leave docs/benchmarks.md alone")
    args = ap.parse_args()
    student, teacher, student_acc, teacher_acc = make_models(args.dir, args.teacher_steps, args.fresh)
    print(f"student after SFT {student_acc:.3f}, teacher {teacher_acc:.3f}", flush=True)
    sides = {
        "GRPO (examples/demo.yaml)": train("examples/demo.yaml", "grpo", args.dir, student, args.steps,
                                           args.eval_every),
        "distill (examples/distill.yaml)": train("examples/distill.yaml", "distill", args.dir, student, args.steps,
                                                 args.eval_every, f"teacher.path={teacher}"),
    }
    lines = ["| side | evals (step:accuracy) | reaches " + f"{args.threshold:g} at step | wall s to it | last |",
             "|---|---|---|---|---|"]
    reached = {}
    for name, evals in sides.items():
        reached[name] = reach(evals, args.threshold)
        at = reached[name]
        lines.append(f"| {name} | {' '.join(f'{s}:{a:.3f}' for s, a, _ in evals)} | "
                     f"{at[0] if at else 'not in ' + str(args.steps)} | {f'{at[1]:.0f}' if at else '-'} | "
                     f"{evals[-1][1]:.3f} |")
    grpo, distill = reached.values()
    ratio = (f"{grpo[0] / distill[0]:.2f}x fewer steps; wall time {distill[1] / grpo[1]:.2f}x GRPO's"
             if grpo and distill and distill[0] and grpo[1] else "-")
    text = ("\n".join(lines) + f"\n\nStart: the demo's flawed warm start, eval accuracy {student_acc:.3f}; teacher "
            f"(4 blocks, {args.teacher_steps} SFT steps on correct answers) {teacher_acc:.3f}. Wall seconds from "
            f"each run's first evaluation, evaluations every {args.eval_every} steps included. GRPO over distillation: "
            f"{ratio}.")
    print(text)
    if not args.no_append:
        append_benchmark("distill: on-policy distillation vs GRPO from the same start (issue 48)", text)
        figure = (f"reaches {args.threshold:g} at step {distill[0]} ({distill[1]:.0f} s)" if distill
                  else f"not {args.threshold:g} in {args.steps} steps")
        reference = (f"GRPO at step {grpo[0]} ({grpo[1]:.0f} s)" if grpo
                     else f"GRPO not {args.threshold:g} in {args.steps} steps")
        record("distill", f"{figure}; teacher {teacher_acc:.3f}", reference, ratio, this_command())


if __name__ == "__main__":
    main()

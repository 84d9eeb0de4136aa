"""Tandem vs TRL's GRPOTrainer on CPU: the same GRPO job, model, data, reward and batch shape.

    .venv/bin/pip install trl==1.16.0 accelerate==1.15.0     # bench-only; torch stays 2.13.0+cpu
    .venv/bin/python bench/vs_trl.py                         # small and medium (~10 minutes; SFT warm starts add ~5 on a first run), appends
    .venv/bin/python bench/vs_trl.py --quick                 # smoke run: small, 4 steps, prints only

Time to reward (where the reward really rises: the demo's flawed-teacher warm start, lr 2e-4;
lr 5e-4 was unstable at staleness 1 and flat on-policy; ~35 minutes after a 3-minute SFT):

    .venv/bin/python bench/vs_trl.py --workdir /tmp/vstrl --presets small \
        --task '{"difficulty": "add1x3", "instruction": false, "teacher_slip": 0.6}' \
        --sft-steps small=800 --sft-lr 3e-3 --sft-schedule cosine --samples 16 --max-new-tokens 8 \
        --steps 150 --lr 2e-4 --staleness 0,1 --seeds 1,2,3 --smooth 10 --threshold 0.40

The medium preset (~2 hours: 14 minutes of SFT, then ~12-24 minutes per run): the same with
`--presets medium --sft-steps medium=500 --steps 120 --seeds 1,2 --timeout 1800`, no `--threshold`.

For each preset: `tandem init-model` makes the model (random init, local tokenizer, ChatML
template), `tandem sft` warm-starts it on the task (the same checkpoint is then the start of both
RL runs, so the reward has somewhere to go), then
- Tandem: `tandem train` with one inference server (`tandem:d1`, core 0) and one trainer rank
  (`archon:d1`, core 1), one torch thread each, staleness 0 (on-policy, like TRL's default);
- TRL: `GRPOTrainer` in a subprocess of this script (`--trl-worker`), `use_cpu=True`, HF `generate`
  in process (no vLLM), one torch thread by default (`--trl-threads`): with two, every op's
  parallel region waits for both threads, and on a shared, loaded 2-core machine TRL's steps went
  from ~2 s to ~16 s mid-run (small preset); one thread measured 0.5 s.

Same for both: the HF directory (weights, tokenizer, chat template), the train items in the same
order (Tandem's `load_task_data`, no shuffling), prompts rendered by the tokenizer's chat template
(checked token for token), the reward (`tandem.data.tasks` arithmetic), 8 prompts x 4 samples x at
most 16 new tokens per step, temperature 1, top-p 1, no top-k, AdamW (lr, betas, eps, weight decay
0.01, grad clip 1.0, constant schedule, no warmup), one optimizer step per batch, PPO clip 0.2, no
KL term, advantages (r - mean_group) / (std_group + 1e-4) with the unbiased std (TRL's rule; Tandem
set to match: `algo.advantage.unbiased_std=true algo.advantage.eps=1e-4`), loss = token mean over
the batch (TRL `loss_type="dapo"`, Tandem's token-mean), fp32, no activation checkpointing (TRL's
default `gradient_checkpointing=True` is turned off).

Reported per framework: completion tokens/s and seconds per step (steady state: steps after the
first `--skip`), the time to reach the same reward (the smoothed batch reward first reaching the
threshold; cumulative step time, and wall time from launch), and the reward each had after the
same amount of training time.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _report import append_benchmark  # bench/ is on sys.path when run as a script
from _run import stop_tandem
from current import record, this_command

TANDEM = str(Path(sys.executable).with_name("tandem"))
TASK_OPTIONS = {"difficulty": "add1", "instruction": False}
SFT_SEED = 1  # experiment.seed of the warm start (RL runs take theirs from --seeds)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    a = p.add_argument
    a("--presets", nargs="+", default=["small", "medium"])
    a("--prompts", type=int, default=8)
    a("--samples", type=int, default=4)
    a("--max-new-tokens", type=int, default=16)
    a("--steps", type=int, default=16, help="RL steps of each run")
    a("--skip", type=int, default=2, help="steps left out of tokens/s and s/step (warm-up)")
    a("--lr", type=float, default=3e-4, help="RL learning rate (both)")
    a("--sft-steps", default="small=40,medium=40", help="warm-start SFT steps per preset")
    a("--sft-lr", type=float, default=2e-3)
    a("--sft-schedule", default="constant", choices=["constant", "linear", "cosine"], help="SFT lr schedule")
    a("--task", default=json.dumps(TASK_OPTIONS),
      help="arithmetic task options as JSON (both frameworks; e.g. the demo's flawed-teacher warm start: "
           '\'{"difficulty": "add1x3", "instruction": false, "teacher_slip": 0.6}\')')
    a("--seeds", default="1", help="comma-separated seeds; each runs TRL and every Tandem staleness (data order, sampling)")
    a("--smooth", type=int, default=3, help="moving-average window of the batch reward")
    a("--threshold", type=float, default=None,
      help="reward to reach (default: the lower of the two runs' best smoothed reward, so both reach it)")
    a("--staleness", default="0,1",
      help="Tandem's rollout.max_head_offpolicyness, one Tandem run each (0 = on-policy like TRL; 1 = async)")
    a("--trl-threads", type=int, default=1,
      help="torch threads of the TRL process (2 collapsed 5-8x on a loaded shared 2-core machine)")
    a("--workdir", default=None, help="models, SFT checkpoints and runs (default: a temporary directory)")
    a("--timeout", type=float, default=900, help="seconds one run may take")
    a("--quick", action="store_true", help="smoke run: small only, 4 RL steps, 20 SFT steps, nothing appended")
    a("--no-append", action="store_true", help="print only; leave docs/benchmarks.md alone")
    a("--trl-worker", default=None, help=argparse.SUPPRESS)  # internal: JSON settings of one TRL run
    args = p.parse_args(argv)
    if args.quick:
        args.presets, args.steps, args.skip, args.sft_steps, args.no_append = ["small"], 4, 1, "small=20", True
    return args


def sft_steps_for(spec: str, preset: str) -> int:
    table = dict(part.split("=") for part in spec.split(","))
    return int(table.get(preset, 100))


# ---------------------------------------------------------------- subprocesses


def run_logged(cmd: list[str], log: Path, timeout: float, env: dict[str, str] | None = None) -> float:
    """Run `cmd` with its output in `log`; -> wall seconds. Raises with the log's tail on failure."""
    start = time.monotonic()
    with log.open("w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, **(env or {})})
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            stop_tandem(proc)
            raise TimeoutError(f"{cmd[1]} took more than {timeout:.0f} s; see {log}") from None
        except BaseException:
            os.killpg(proc.pid, signal.SIGINT)
            proc.wait()
            raise
    if rc != 0:
        raise RuntimeError(f"{' '.join(cmd[:3])} exited with {rc}:\n{log.read_text()[-3000:]}")
    return time.monotonic() - start


def common_overrides(args: argparse.Namespace, root: Path, name: str, trial: str, seed: int) -> list[str]:
    return [
        f"experiment.fileroot={root / 'runs'}",
        f"experiment.name={name}",
        f"experiment.trial={trial}",
        f"experiment.seed={seed}",
        "task.name=arithmetic",
        "task.options=" + args.task,
        "stats.progress=false",
        "stats.tensorboard=false",
        "stats.plot=false",
    ]


def prepare_model(args: argparse.Namespace, root: Path, preset: str) -> tuple[Path, float, float]:
    """Random init + SFT warm start (cached in the work directory); -> (HF dir, eval accuracy, s)."""
    base, sft = root / f"base-{preset}", root / f"sft-{preset}"
    steps = sft_steps_for(args.sft_steps, preset)
    stamp = sft / "bench-sft.json"
    if stamp.is_file() and json.loads(stamp.read_text()).get("steps") == steps:
        info = json.loads(stamp.read_text())
        return sft, info["accuracy"], info["seconds"]
    if not (base / "config.json").is_file():
        subprocess.run([TANDEM, "init-model", str(base), "--preset", preset, "--seed", "0"], check=True,
                       stdout=subprocess.DEVNULL)
    shutil.rmtree(root / "runs" / "sft" / preset, ignore_errors=True)
    seconds = run_logged([TANDEM, "sft", f"actor.path={base}", *common_overrides(args, root, "sft", preset, SFT_SEED),
                          "actor.backend=archon:d1", "actor.num_threads=1", f"actor.optimizer.lr={args.sft_lr}",
                          f"sft.steps={steps}", "sft.batch_size=32",
                          f"actor.optimizer.lr_scheduler={args.sft_schedule}",
                          f"actor.optimizer.warmup_steps_proportion={0.0 if args.sft_schedule == 'constant' else 0.05}",
                          f"sft.output={sft}", "task.eval_size=64",
                          f"gen.max_new_tokens={args.max_new_tokens}", "rollout.server_args=[--num-threads,1]"],
                         root / f"sft-{preset}.log", args.timeout)
    rows = [json.loads(line) for line in (root / "runs" / "sft" / preset / "sft-metrics.jsonl").read_text().splitlines()]
    accuracy = next(r["eval/accuracy"] for r in reversed(rows) if "eval/accuracy" in r)
    stamp.write_text(json.dumps({"steps": steps, "accuracy": accuracy, "seconds": seconds}))
    return sft, accuracy, seconds


def run_tandem(args: argparse.Namespace, root: Path, preset: str, model: Path, staleness: int, seed: int) -> dict:
    trial = f"tandem-{preset}-s{staleness}-seed{seed}"
    run_dir = root / "runs" / "vs_trl" / trial
    shutil.rmtree(run_dir, ignore_errors=True)
    wall = run_logged([
        TANDEM, "train", f"actor.path={model}", *common_overrides(args, root, "vs_trl", trial, seed),
        "rollout.backend=tandem:d1", "actor.backend=archon:d1", "rollout.cpus=0", "actor.cpus=1",
        "rollout.server_args=[--num-threads,1]", "actor.num_threads=1",
        f"rollout.max_head_offpolicyness={staleness}",
        f"rollout.consumer_batch_size={args.prompts}", f"gen.n_samples={args.samples}",
        f"gen.max_new_tokens={args.max_new_tokens}", "gen.temperature=1.0", "gen.top_p=1.0", "gen.top_k=-1",
        f"actor.optimizer.lr={args.lr}", "actor.optimizer.weight_decay=0.01", "actor.optimizer.lr_scheduler=constant",
        "actor.optimizer.gradient_clipping=1.0", "actor.mb.max_tokens_per_mb=2048",
        "algo.advantage.unbiased_std=true", "algo.advantage.eps=1e-4", "algo.ppo.eps_clip=0.2", "algo.ppo.kl_ctl=0",
        f"train.total_steps={args.steps}", "task.eval_size=4", f"task.train_size={args.steps * args.prompts}",
    ], root / f"{trial}.log", args.timeout)
    rows = [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
            if r.get("phase") == "rl" and "time/train" in r]
    steps = [{
        "step": r["step"],
        "seconds": r["time/generation"] + r["time/train"] + r["time/sync"],
        "reward": r["reward/mean"],
        "completion_tokens": r["gen/response_len_mean"] * args.prompts * args.samples,
    } for r in rows]
    return {"steps": steps, "wall": wall}


def run_trl(args: argparse.Namespace, root: Path, preset: str, model: Path, seed: int) -> dict:
    out = root / "runs" / "vs_trl" / f"trl-{preset}-seed{seed}"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    settings = {"model": str(model), "out": str(out), "prompts": args.prompts, "samples": args.samples,
                "max_new_tokens": args.max_new_tokens, "steps": args.steps, "lr": args.lr,
                "threads": args.trl_threads, "task": json.loads(args.task), "seed": seed}
    wall = run_logged([sys.executable, str(Path(__file__).resolve()), "--trl-worker", json.dumps(settings)],
                      root / f"trl-{preset}-seed{seed}.log", args.timeout, env={"OMP_NUM_THREADS": str(args.trl_threads)})
    steps = json.loads((out / "steps.json").read_text())
    return {"steps": steps, "wall": wall, "versions": json.loads((out / "versions.json").read_text())}


# ---------------------------------------------------------------- the TRL side (a subprocess)


def trl_worker(settings: dict) -> None:
    import torch

    torch.set_num_threads(settings["threads"])
    import accelerate
    import datasets
    import transformers
    import trl
    from transformers import AutoTokenizer, TrainerCallback

    from tandem.rl.config import TandemConfig
    from tandem.rl.data import load_task_data

    out = Path(settings["out"])
    n_items = settings["steps"] * settings["prompts"]
    cfg = TandemConfig()
    cfg.experiment.seed = settings["seed"]
    cfg.task.name, cfg.task.options = "arithmetic", dict(settings["task"])
    cfg.task.train_size, cfg.task.eval_size = n_items, 1
    tokenizer = AutoTokenizer.from_pretrained(settings["model"])
    data = load_task_data(cfg, tokenizer)  # Tandem's items, in Tandem's order, with its prompt ids
    task = data.task
    fields = ["answer", "expression", "task", "split", "id"]
    rows = {"prompt": [item["messages"] for item in data.train], **{k: [item[k] for item in data.train] for k in fields}}
    dataset = datasets.Dataset.from_dict(rows)
    # The same prompt tokens as Tandem's (`with_input_ids`): TRL renders the messages with the
    # tokenizer's chat template and add_generation_prompt=True.
    for item in data.train[:4]:
        trl_ids = tokenizer.apply_chat_template(item["messages"], add_generation_prompt=True, tokenize=True)
        trl_ids = trl_ids["input_ids"] if hasattr(trl_ids, "keys") else trl_ids  # a BatchEncoding
        assert list(trl_ids) == list(item["input_ids"]), "prompt token ids differ between TRL and Tandem"

    def arithmetic_reward(prompts, completions, **kw):
        out = []
        for i, completion in enumerate(completions):
            text = completion[-1]["content"] if isinstance(completion, list) else completion
            out.append(task.reward(text, {k: kw[k][i] for k in fields}))
        return out

    steps: list[dict] = []

    class Timer(TrainerCallback):
        def on_step_begin(self, args_, state, control, **kw):
            self.t0 = time.perf_counter()

        def on_step_end(self, args_, state, control, **kw):
            steps.append({"step": state.global_step, "seconds": time.perf_counter() - self.t0})

        def on_log(self, args_, state, control, logs=None, **kw):
            if logs and "reward" in logs and steps:
                steps[-1]["reward"] = logs["reward"]
                steps[-1]["completion_tokens"] = logs["completions/mean_length"] * settings["prompts"] * settings["samples"]

    config = trl.GRPOConfig(
        output_dir=str(out / "trainer"),
        use_cpu=True,
        bf16=False,
        fp16=False,
        gradient_checkpointing=False,
        per_device_train_batch_size=settings["prompts"] * settings["samples"],
        gradient_accumulation_steps=1,
        num_generations=settings["samples"],
        max_completion_length=settings["max_new_tokens"],
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        learning_rate=settings["lr"],
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.01,
        adam_beta1=0.9,
        adam_beta2=0.999,
        adam_epsilon=1e-8,
        max_grad_norm=1.0,
        beta=0.0,
        epsilon=0.2,
        num_iterations=1,
        loss_type="dapo",
        scale_rewards="group",
        shuffle_dataset=False,
        max_steps=settings["steps"],
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        seed=settings["seed"],
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    model = transformers.AutoModelForCausalLM.from_pretrained(settings["model"], dtype=torch.float32)
    trainer = trl.GRPOTrainer(model=model, reward_funcs=[arithmetic_reward], args=config, train_dataset=dataset,
                              processing_class=tokenizer, callbacks=[Timer()])
    trainer.train()
    (out / "steps.json").write_text(json.dumps(steps))
    (out / "versions.json").write_text(json.dumps({
        "trl": trl.__version__, "transformers": transformers.__version__, "accelerate": accelerate.__version__,
        "torch": torch.__version__, "datasets": datasets.__version__,
    }))


# ---------------------------------------------------------------- analysis


def summarize(run: dict, skip: int, smooth: int) -> dict:
    steps = run["steps"]
    steady = steps[skip:] or steps
    seconds = sum(s["seconds"] for s in steady)
    cum, t = [], 0.0
    for s in steps:
        t += s["seconds"]
        cum.append(t)
    rewards = [s["reward"] for s in steps]
    smoothed = [statistics.mean(rewards[max(0, i - smooth + 1): i + 1]) for i in range(len(rewards))]
    return {
        "tok_s": sum(s["completion_tokens"] for s in steady) / seconds,
        "s_step": seconds / len(steady),
        "len": statistics.mean(s["completion_tokens"] for s in steps) / 1.0,
        "cum": cum,
        "smoothed": smoothed,
        # Only full windows count: a one-step "average" at the start is a single noisy batch.
        "best": max(smoothed[min(smooth, len(smoothed)) - 1:]),
        "first": smoothed[min(smooth, len(smoothed)) - 1],
        "smooth": smooth,
        "last": smoothed[-1],
        "train_s": cum[-1],
        "wall": run["wall"],
    }


def reach(summary: dict, threshold: float) -> tuple[int, float] | None:
    """(step, training seconds) of the first full smoothing window at or above `threshold`."""
    for i, value in enumerate(summary["smoothed"]):
        if i + 1 >= summary["smooth"] and value >= threshold - 1e-9:
            return i + 1, summary["cum"][i]
    return None


def reward_at(summary: dict, seconds: float) -> float:
    """Smoothed reward of the last step finished by `seconds` of training time."""
    value = summary["smoothed"][0]
    for cum, r in zip(summary["cum"], summary["smoothed"], strict=True):
        if cum <= seconds + 1e-9:
            value = r
    return value


def fmt_reach(r: tuple[int, float] | None) -> str:
    return f"step {r[0]}, {r[1]:.0f} s" if r else "not reached"


def median_reach(summaries: list[dict], threshold: float) -> float | None:
    """Median training seconds to the threshold over seeds; a seed that never reaches it counts as
    infinitely slow (so the median is None when half or more of the seeds miss it)."""
    times = sorted(r[1] if (r := reach(s, threshold)) else float("inf") for s in summaries)
    value = statistics.median(times)
    return None if value == float("inf") else value


def main() -> None:
    args = parse_args()
    if args.trl_worker:
        trl_worker(json.loads(args.trl_worker))
        return
    t_start = time.monotonic()
    rows, agg_rows, notes, versions = [], [], [], {}
    reached: list[tuple[str, int, float, float | None, float | None]] = []  # preset, staleness, threshold, Tandem / TRL median s
    stalenesses = [int(x) for x in args.staleness.split(",")]
    seeds = [int(x) for x in args.seeds.split(",")]

    with tempfile.TemporaryDirectory(prefix="vs_trl-") as tmp:
        root = Path(args.workdir or tmp).resolve()
        root.mkdir(parents=True, exist_ok=True)
        for p_index, preset in enumerate(args.presets):
            model, sft_acc, sft_s = prepare_model(args, root, preset)
            print(f"{preset}: SFT warm start -> eval accuracy {sft_acc:.3f} (SFT took {sft_s:.0f} s, or was cached)",
                  flush=True)
            trl: dict[int, dict] = {}
            tan: dict[tuple[int, int], dict] = {}
            for s_index, seed in enumerate(seeds):
                # Alternate which framework goes first (a shared machine drifts).
                order = ["tandem", "trl"] if (p_index + s_index) % 2 == 0 else ["trl", "tandem"]
                for name in order:
                    if name == "trl":
                        run = run_trl(args, root, preset, model, seed)
                        versions = run.get("versions", versions)
                        trl[seed] = summarize(run, args.skip, args.smooth)
                        print(f"{preset} seed {seed}: trl done in {run['wall']:.0f} s", flush=True)
                        continue
                    for st in stalenesses:
                        run = run_tandem(args, root, preset, model, st, seed)
                        tan[st, seed] = summarize(run, args.skip, args.smooth)
                        print(f"{preset} seed {seed}: tandem (staleness {st}) done in {run['wall']:.0f} s", flush=True)
            everything = [*trl.values(), *tan.values()]
            # One threshold for every run of the preset: declared (--threshold), or the lowest best
            # smoothed reward of all runs, so each run reaches it.
            threshold = args.threshold if args.threshold is not None else min(x["best"] for x in everything)
            same_time = min(x["train_s"] for x in everything)
            for seed in seeds:
                r_trl = reach(trl[seed], threshold)
                for st in stalenesses:
                    t = tan[st, seed]
                    r_tan = reach(t, threshold)
                    ratio = f"{r_trl[1] / r_tan[1]:.2f}x" if r_tan and r_trl else "n/a"
                    rows.append(
                        f"| {preset}, seed {seed}, staleness {st} | {sft_acc:.2f} | {t['tok_s']:.0f} | "
                        f"{trl[seed]['tok_s']:.0f} | {t['tok_s'] / trl[seed]['tok_s']:.2f}x "
                        f"| {t['s_step']:.2f} | {trl[seed]['s_step']:.2f} | {trl[seed]['s_step'] / t['s_step']:.2f}x "
                        f"| {threshold:.3f} | {fmt_reach(r_tan)} | {fmt_reach(r_trl)} | {ratio} "
                        f"| {reward_at(t, same_time):.3f} / {reward_at(trl[seed], same_time):.3f} "
                        f"| {t['first']:.3f} -> {t['last']:.3f} | {trl[seed]['first']:.3f} -> {trl[seed]['last']:.3f} "
                        f"| {t['wall']:.0f} / {trl[seed]['wall']:.0f} |"
                    )
                    print(rows[-1], flush=True)
                notes.append(f"{preset} seed {seed} trl: smoothed reward per step "
                             + " ".join(f"{v:.2f}" for v in trl[seed]["smoothed"]))
                for st in stalenesses:
                    notes.append(f"{preset} seed {seed} tandem staleness {st}: smoothed reward per step "
                                 + " ".join(f"{v:.2f}" for v in tan[st, seed]["smoothed"]))
            trl_all = [trl[seed] for seed in seeds]
            m_trl = median_reach(trl_all, threshold)
            for st in stalenesses:
                tan_all = [tan[st, seed] for seed in seeds]
                m_tan = median_reach(tan_all, threshold)
                ratio = f"{m_trl / m_tan:.2f}x" if m_tan and m_trl else "n/a"
                reached.append((preset, st, threshold, m_tan, m_trl))
                agg_rows.append(
                    f"| {preset}, staleness {st} | {len(seeds)} | {threshold:.3f} "
                    f"| {', '.join(fmt_reach(reach(x, threshold)) for x in tan_all)} "
                    f"| {', '.join(fmt_reach(reach(x, threshold)) for x in trl_all)} "
                    f"| {f'{m_tan:.0f} s' if m_tan else 'n/a'} / {f'{m_trl:.0f} s' if m_trl else 'n/a'} | {ratio} "
                    f"| {same_time:.0f} s: {statistics.mean(reward_at(x, same_time) for x in tan_all):.3f} / "
                    f"{statistics.mean(reward_at(x, same_time) for x in trl_all):.3f} "
                    f"| {statistics.median(x['tok_s'] for x in tan_all) / statistics.median(x['tok_s'] for x in trl_all):.2f}x |"
                )
                print(agg_rows[-1], flush=True)
    header = (
        "| preset, seed, Tandem staleness | SFT eval acc | Tandem completion tok/s | TRL tok/s | ratio | Tandem s/step | TRL s/step | ratio "
        "| reward threshold | Tandem reaches it | TRL reaches it | TRL time / Tandem time | reward after the same "
        "training time (Tandem / TRL) | Tandem reward first -> last | TRL reward first -> last | wall s incl. start-up "
        "(Tandem / TRL) |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---|---:|---|---|---|---|"
    )
    agg_header = (
        "| preset, Tandem staleness | seeds | reward threshold | Tandem reaches it (per seed) | TRL reaches it (per seed) "
        "| median training time to it (Tandem / TRL) | TRL time / Tandem time | mean reward after the same training "
        "time (Tandem / TRL) | median tok/s ratio |\n|---|---:|---:|---|---|---|---:|---|---:|"
    )
    version_line = ", ".join(f"{k} {v}" for k, v in versions.items())
    body = (
        f"`bench/vs_trl.py`: GRPO on arithmetic with task options `{args.task}`, {args.prompts} prompts x {args.samples} samples x at most "
        f"{args.max_new_tokens} new tokens per step, {args.steps} steps, lr {args.lr:g}, seeds {args.seeds} (data order and "
        f"sampling; both frameworks), from a `tandem sft` warm start "
        f"(random init -> SFT with lr {args.sft_lr:g} {args.sft_schedule}, batch 32; steps {args.sft_steps}). Tandem: `tandem train`, one "
        "server (`tandem:d1`, core 0) + one trainer rank (`archon:d1`, core 1), one thread each, "
        f"`rollout.max_head_offpolicyness` {args.staleness} (one run each: 0 is on-policy like TRL, 1 overlaps "
        "generation with training), "
        "`actor.mb.max_tokens_per_mb=2048` (one micro-batch per step). TRL: `GRPOTrainer` (CPU, HF `generate` in process, no vLLM), "
        f"{args.trl_threads} torch threads. Versions: {version_line}. Tokens/s and s/step over steps "
        f"{args.skip + 1}-{args.steps} (the step's own timers: Tandem's `time/*`, a TRL callback around each "
        f"optimizer step); reward = batch mean, smoothed over {args.smooth} steps (full windows only); time to reach = training time "
        "summed over steps up to the first step at or above the threshold (start-up and evaluation excluded); "
        + ("threshold declared before the run (`--threshold`)." if args.threshold is not None else
           "threshold = the lowest best smoothed reward over all runs of the preset, so every run reaches it.")
        + "\n\nSummary over seeds:\n\n" + agg_header + "\n" + "\n".join(agg_rows)
        + "\n\nPer run:\n\n" + header + "\n" + "\n".join(rows) + "\n\n" + "\n".join(f"- {n}" for n in notes)
    )
    print("\n" + body)
    print(f"\nbenchmark took {time.monotonic() - t_start:.0f} s")
    if not args.no_append:
        path = append_benchmark("Tandem vs TRL GRPOTrainer (CPU)", body)
        print(f"appended to {path}")
        record_current(reached, len(seeds))


def record_current(reached: list[tuple[str, int, float, float | None, float | None]], n_seeds: int) -> None:
    """The Current figures row: median training time to the reward threshold, Tandem and TRL."""
    def secs(value: float | None) -> str:
        return f"{value:.0f} s" if value else "not reached"

    presets = dict.fromkeys(p for p, *_ in reached)
    figure = "; ".join(
        f"{p}, training time to reward {next(t for q, _, t, _, _ in reached if q == p):.3f} (median of {n_seeds} "
        "seeds): " + ", ".join(f"{secs(m)} at staleness {st}" for q, st, _, m, _ in reached if q == p)
        for p in presets)
    reference = "TRL GRPOTrainer " + "; ".join(
        f"{p} {secs(next(m for q, _, _, _, m in reached if q == p))}" for p in presets)
    ratio = " / ".join(f"{trl / tan:.2f}x" if tan and trl else "n/a" for _, _, _, tan, trl in reached) + " less time"
    record("vs_trl", figure, reference, ratio, this_command())


if __name__ == "__main__":
    main()

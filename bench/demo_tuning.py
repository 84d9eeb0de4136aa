"""Find settings for the demo RL job: tiny model -> short SFT -> GRPO, eval accuracy over time.

    .venv/bin/python bench/demo_tuning.py --difficulty add2 --preset tiny --seed 0 \
        --sft-steps 60 --sft-lr 3e-3 --rl-steps 40 --rl-lr 1e-3 --prompts 16 --samples 8

An in-process, synchronous (staleness 0) prototype of the demo job built from the same components
the real loop uses: `init_model` (random init + local tokenizer), `TrainEngine` for SFT and for RL
(`recipe`, `add_advantages`, `set_prox_logprobs`, `make_policy_loss`), `LLMEngine` for rollouts and
greedy eval, weights moved trainer -> inference engine after every step with `export_weights` ->
`load_weights`. Prints a table of (phase, step, accuracy, sample reward, time) and, with `--json`,
writes every row plus the settings to a file. Not a test; see docs/demo-tuning.md for results.

Timings are wall clock and process CPU time of this one process (`--threads` intra-op threads).
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from current import record, this_command  # bench/ is on sys.path when run as a script

from tandem.algo import (
    add_advantages,
    batch_logprob_mismatch,
    dynamic_filter,
    make_policy_loss,
    policy_loss_weight,
    recipe,
    set_prox_logprobs,
    shape_rewards,
    summarize_stats,
)
from tandem.data.tasks import get_task
from tandem.data.tasks.chat import encode_prompt, sft_example
from tandem.data.trajectory import Trajectory
from tandem.inference import LLMEngine, SamplingParams
from tandem.models.tiny import init_model
from tandem.train import MicroBatchConfig, SequenceBatch, TrainEngine, TrainEngineConfig, sft_loss
from tandem.train.config import OptimizerConfig

BUCKET_BYTES = 64 << 20


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    a = p.add_argument
    # task and model
    a("--difficulty", default="add2", help="arithmetic preset (add1, addsub1, add1x3, mixed1, add2, ...)")
    a("--instruction", action="store_true", help="append the \\boxed{} instruction to prompts")
    a("--teacher-slip", type=float, default=0.0, help="share of SFT targets missing the last term")
    a("--eval-fraction", type=float, default=0.2, help="task eval_fraction (share of problems in eval)")
    a("--preset", default="tiny", choices=["tiny", "small", "medium"])
    a("--arch", default="qwen3", choices=["qwen3", "qwen2"])
    a("--seed", type=int, default=0, help="model init, data order and sampling seed")
    a("--workdir", default=None, help="where the model and checkpoints go (default: a temp dir)")
    a("--threads", type=int, default=2)
    # SFT
    a("--sft-steps", type=int, default=60)
    a("--sft-batch", type=int, default=32)
    a("--sft-lr", type=float, default=3e-3)
    a("--sft-items", type=int, default=0, help="distinct train problems used for SFT (0 = fresh every batch)")
    a("--sft-warmup", type=float, default=0.05, help="warmup proportion")
    a("--sft-schedule", default="constant", choices=["constant", "linear", "cosine"])
    a("--sft-from", default=None, help="skip init + SFT: start RL from this HF directory (a previous run's sft/)")
    a("--sft-eval-every", type=int, default=0, help="also eval during SFT (0 = only at the end)")
    # RL
    a("--algo", default="grpo", help="recipe: grpo, dr_grpo, rloo, dapo, gspo")
    a("--rl-steps", type=int, default=40)
    a("--rl-lr", type=float, default=1e-3)
    a("--rl-schedule", default="constant", choices=["constant", "linear", "cosine"])
    a("--rl-warmup", type=float, default=0.0, help="warmup proportion of the RL lr schedule")
    a("--prompts", type=int, default=16, help="prompts per RL step")
    a("--samples", type=int, default=8, help="samples per prompt (group size)")
    a("--temperature", type=float, default=1.0)
    a("--max-new-tokens", type=int, default=12)
    a("--rl-items", type=int, default=0, help="distinct train problems RL draws from (0 = fresh every step)")
    a("--adv-mean", default=None, choices=["batch", "group", "none"], help="override the recipe's baseline")
    a("--adv-std", default=None, choices=["batch", "group", "none"], help="override the recipe's std level")
    a("--filter", action="store_true", help="dynamic filtering (drop groups with equal rewards)")
    a("--grad-clip", type=float, default=1.0)
    a("--weight-decay", type=float, default=0.0)
    a("--beta2", type=float, default=0.999)
    a("--mb-tokens", type=int, default=1024, help="trainer micro-batch token budget (CPU attention is O(T^2))")
    # eval
    a("--eval-items", type=int, default=200)
    a("--eval-every", type=int, default=10)
    a("--eval-seed", type=int, default=1234, help="which eval problems (fixed across runs by default)")
    a("--json", default=None, help="write settings + rows to this file")
    a("--record", action="store_true",
      help="write the summary to the demo_tuning row of docs/benchmarks.md's Current figures table")
    return p.parse_args(argv)


class Clock:
    """Wall and process-CPU seconds spent per phase."""

    def __init__(self):
        self.wall: dict[str, float] = {}
        self.cpu: dict[str, float] = {}
        self.t0, self.c0 = time.perf_counter(), time.process_time()

    def phase(self, name: str):
        clock = self

        class _Ctx:
            def __enter__(self):
                self.w, self.c = time.perf_counter(), time.process_time()

            def __exit__(self, *exc):
                clock.wall[name] = clock.wall.get(name, 0.0) + time.perf_counter() - self.w
                clock.cpu[name] = clock.cpu.get(name, 0.0) + time.process_time() - self.c

        return _Ctx()

    def elapsed(self) -> tuple[float, float]:
        return time.perf_counter() - self.t0, time.process_time() - self.c0


def sync_weights(trainer: TrainEngine, llm: LLMEngine, version: int) -> None:
    llm.load_weights(itertools.chain.from_iterable(trainer.export_weights(BUCKET_BYTES)),
                     weight_version=version)


def evaluate(llm: LLMEngine, task, items, prompts, max_new_tokens: int) -> dict[str, float]:
    outs = llm.generate(prompts, SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0),
                        return_logprob=False)
    rewards = [task.reward(o.text, it) for o, it in zip(outs, items, strict=True)]
    return {"acc": sum(rewards) / len(rewards), "len": statistics.mean(len(o.output_ids) for o in outs)}


def make_trainer(path: Path, lr: float, steps: int, schedule: str, warmup: float, args) -> TrainEngine:
    return TrainEngine(TrainEngineConfig(
        path=str(path), seed=args.seed, total_train_steps=max(steps, 1),
        optimizer=OptimizerConfig(lr=lr, lr_scheduler=schedule, warmup_steps_proportion=warmup,
                                  gradient_clipping=args.grad_clip, weight_decay=args.weight_decay,
                                  beta2=args.beta2),
        mb=MicroBatchConfig(max_tokens_per_mb=args.mb_tokens),
    ))


def run(args: argparse.Namespace) -> dict:
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    clock = Clock()
    work = Path(args.workdir or tempfile.mkdtemp(prefix="demo-tuning-"))
    rows: list[dict] = []

    def log(phase: str, step: int, acc: float | None = None, **extra) -> None:
        wall, cpu = clock.elapsed()
        row = {"phase": phase, "step": step, "acc": acc, "wall": round(wall, 1), "cpu": round(cpu, 1), **extra}
        rows.append(row)
        acc_s = f"{acc:6.3f}" if acc is not None else "     -"
        rest = "  ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in extra.items())
        print(f"{phase:5s} {step:4d}  acc {acc_s}  wall {wall:6.1f}s  cpu {cpu:6.1f}s  {rest}", flush=True)

    task = get_task("arithmetic", difficulty=args.difficulty, instruction=args.instruction,
                    eval_fraction=args.eval_fraction, teacher_slip=args.teacher_slip)
    eval_items = task.generate(args.eval_items, seed=args.eval_seed, split="eval")
    # Small splits repeat once exhausted; evaluate each problem once.
    seen: set[str] = set()
    eval_items = [it for it in eval_items if not (it["prompt"] in seen or seen.add(it["prompt"]))]

    with clock.phase("init"):
        model_dir = Path(args.sft_from) if args.sft_from else \
            init_model(work / "init", arch=args.arch, preset=args.preset, seed=args.seed, overwrite=True)
        llm = LLMEngine(model_dir, max_num_seqs=512, kv_cache_tokens=65536, block_size=16, seed=args.seed)
        tok = llm.detokenizer.tokenizer
        eval_prompts = [encode_prompt(it, tok) for it in eval_items]
    print(f"task arithmetic/{args.difficulty} instruction={args.instruction}  eval problems {len(eval_items)}  "
          f"model {args.preset}  workdir {work}", flush=True)
    eval_len = args.max_new_tokens

    with clock.phase("eval"):
        ev = evaluate(llm, task, eval_items, eval_prompts, eval_len)
    log("init", 0, ev["acc"], gen_len=ev["len"])

    # ------------------------------------------------------------------ SFT
    sft_dir = work / "sft"
    if args.sft_steps > 0 and not args.sft_from:
        with clock.phase("sft"):
            trainer = make_trainer(model_dir, args.sft_lr, args.sft_steps, args.sft_schedule, args.sft_warmup, args)
            pool = task.generate(args.sft_items, seed=args.seed, split="train") if args.sft_items else None
            fresh = iter(task.generate(args.sft_steps * args.sft_batch, seed=args.seed, split="train")) \
                if not pool else None
        for step in range(1, args.sft_steps + 1):
            with clock.phase("sft"):
                items = [rng.choice(pool) for _ in range(args.sft_batch)] if pool else \
                    [next(fresh) for _ in range(args.sft_batch)]
                exs = [sft_example(it, tok, task) for it in items]
                batch = SequenceBatch.from_token_lists([e["input_ids"] for e in exs],
                                                       loss_mask=[e["loss_mask"] for e in exs])
                st = trainer.train_batch(batch, sft_loss)
            if args.sft_eval_every and step % args.sft_eval_every == 0 and step < args.sft_steps:
                with clock.phase("sft"):
                    sync_weights(trainer, llm, 0)
                with clock.phase("eval"):
                    ev = evaluate(llm, task, eval_items, eval_prompts, eval_len)
                log("sft", step, ev["acc"], loss=st["loss"], lr=st["lr"])
            elif step % max(args.sft_steps // 4, 1) == 0 or step == args.sft_steps:
                log("sft", step, None, loss=st["loss"], lr=st["lr"])
        with clock.phase("sft"):
            trainer.save_hf(sft_dir, tokenizer_dir=model_dir, overwrite=True)
            sync_weights(trainer, llm, 0)
            trainer.close()
    else:
        sft_dir = model_dir
    with clock.phase("eval"):
        ev = evaluate(llm, task, eval_items, eval_prompts, eval_len)
    log("sft", args.sft_steps, ev["acc"], gen_len=ev["len"])
    acc_start = ev["acc"]

    # ------------------------------------------------------------------ RL
    cfg = recipe(args.algo, max_new_tokens=args.max_new_tokens, max_head_offpolicyness=0)
    if args.filter:
        cfg.ppo.dynamic_filtering = True
    if args.adv_mean:
        cfg.advantage.mean_level = args.adv_mean
    if args.adv_std:
        cfg.advantage.std_level = args.adv_std
    with clock.phase("rl"):
        trainer = make_trainer(sft_dir, args.rl_lr, args.rl_steps, args.rl_schedule, args.rl_warmup, args)
        rl_pool = task.generate(args.rl_items, seed=args.seed + 1, split="train") if args.rl_items else None
        rl_fresh = iter(task.generate(args.rl_steps * args.prompts, seed=args.seed + 1, split="train")) \
            if not rl_pool else None
    acc_end = acc_start
    for step in range(1, args.rl_steps + 1):
        version = step - 1
        with clock.phase("rollout"):
            items = [rng.choice(rl_pool) for _ in range(args.prompts)] if rl_pool else \
                [next(rl_fresh) for _ in range(args.prompts)]
            prompts = [encode_prompt(it, tok) for it in items]
            params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                                    n=args.samples, seed=rng.randrange(1 << 30))
            outs = llm.generate(prompts, params, return_logprob=True)
            trajs = []
            for o in outs:
                p = int(o.rid.rsplit("-", 1)[1])
                trajs.append(Trajectory.from_generation(
                    prompts[p], o.output_ids, o.output_logprobs, [version] * len(o.output_ids),
                    reward=task.reward(o.text, items[p]), group_id=f"s{step}p{p}"))
        raw = [t.reward for t in trajs]
        with clock.phase("train"):
            rewards = shape_rewards(raw, cfg.reward, [t.num_generated for t in trajs])
            if cfg.ppo.dynamic_filtering:
                kept = dynamic_filter(rewards, [t.group_id for t in trajs]).kept_indices
                trajs, rewards = [trajs[i] for i in kept], rewards[kept]
            st, s, mism = {}, {}, float("nan")
            if trajs:
                batch = SequenceBatch([t.to_tensors() for t in trajs])
                add_advantages(batch, cfg.advantage, group_ids=[t.group_id for t in trajs], rewards=rewards)
                set_prox_logprobs(batch, trainer.forward_logprobs(batch, loss_tokens_only=True).logprobs)
                mism = batch_logprob_mismatch(batch, current_version=version)["mismatch/max"]
                st = trainer.train_batch(batch, make_policy_loss(cfg.ppo, version=version, stats=s),
                                         policy_loss_weight)
                s = summarize_stats(s)
        with clock.phase("sync"):
            sync_weights(trainer, llm, step)
        groups = [raw[i:i + args.samples] for i in range(0, len(raw), args.samples)]
        extra = {"reward": sum(raw) / len(raw),
                 "pass@g": sum(max(g) > 0 for g in groups) / len(groups),
                 "mixed": sum(min(g) != max(g) for g in groups) / len(groups),
                 "len": statistics.mean(t.num_generated for t in trajs) if trajs else 0.0,
                 "ent": s.get("entropy", float("nan")), "gnorm": st.get("grad_norm", float("nan")),
                 "mism": mism}
        if step % args.eval_every == 0 or step == args.rl_steps:
            with clock.phase("eval"):
                ev = evaluate(llm, task, eval_items, eval_prompts, eval_len)
            acc_end = ev["acc"]
            log("rl", step, ev["acc"], **extra)
        else:
            log("rl", step, None, **extra)
    trainer.close()
    if dist.is_initialized():
        dist.destroy_process_group()

    wall, cpu = clock.elapsed()
    summary = {"acc_sft": acc_start, "acc_rl": acc_end, "gain": acc_end - acc_start,
               "wall": wall, "cpu": cpu,
               "phase_wall": {k: round(v, 1) for k, v in clock.wall.items()},
               "phase_cpu": {k: round(v, 1) for k, v in clock.cpu.items()}}
    print(f"SUMMARY acc after SFT {acc_start:.3f} -> after RL {acc_end:.3f} (gain {acc_end - acc_start:+.3f})  "
          f"wall {wall:.0f}s cpu {cpu:.0f}s  phases wall {summary['phase_wall']}  cpu {summary['phase_cpu']}",
          flush=True)
    result = {"args": vars(args), "rows": rows, "summary": summary}
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    if args.record:
        record("demo_tuning", f"greedy eval accuracy {acc_start:.3f} after SFT -> {acc_end:.3f} after "
               f"{args.rl_steps} RL steps (gain {acc_end - acc_start:+.3f}), {wall:.0f} s", f"after SFT {acc_start:.3f}",
               "", this_command())
    return result


if __name__ == "__main__":
    run(parse_args())

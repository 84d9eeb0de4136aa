"""`tandem train`: asynchronous RL end to end.

One step, as data (see docs/architecture.md):
  1. the rollout controller hands over the oldest `batch_size` accepted episodes while the fleet
     keeps generating ahead, up to the staleness bound;
  2. rewards are shaped, groups filtered, advantages computed (on the controller: group
     normalisation needs whole groups);
  3. the batch is split across data-parallel ranks by Karmarkar–Karp, each rank recomputes the
     proximal logprobs and runs the decoupled PPO update on its shard;
  4. the trainer pushes the new weights to every server (pause -> transfer -> commit -> version ->
     continue), which bumps the version the staleness bound counts from;
  5. stats, evaluation and checkpoints on their timers.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tandem.config.loader import to_yaml
from tandem.config.schema import TandemConfig
from tandem.launch import LocalScheduler
from tandem.rl.batch import build_training_batch
from tandem.rl.cluster import run_dir_of, start_servers, start_workers
from tandem.rl.data import CursorLoader, load_task_data
from tandem.rl.dispatch import split_for_ranks
from tandem.rl.evaluate import evaluate
from tandem.rl.metrics import MetricsLogger
from tandem.rl.plot import plot_run
from tandem.rl.progress import Progress
from tandem.rollout.controller import RolloutController
from tandem.rollout.types import GenerationParams
from tandem.rollout.workflows.rlvr import RLVRWorkflow
from tandem.weights.meta import WeightUpdateMeta

logger = logging.getLogger(__name__)
LOOP_STATE = "loop_state.json"


@dataclass
class RunSummary:
    run_dir: Path
    steps: int
    eval_before: float | None = None
    eval_after: float | None = None
    seconds: float = 0.0
    time_split: dict[str, float] = field(default_factory=dict)

    def describe(self) -> str:
        lines = [f"run directory: {self.run_dir}", f"steps: {self.steps} in {self.seconds:.0f} s"]
        if self.eval_before is not None and self.eval_after is not None:
            lines.append(
                f"eval accuracy: {self.eval_before:.3f} -> {self.eval_after:.3f} "
                f"({self.eval_after - self.eval_before:+.3f})"
            )
        if self.time_split:
            lines.append("time: " + ", ".join(f"{k} {v:.0f} s" for k, v in self.time_split.items()))
        return "\n".join(lines)


def weight_update_meta(cfg: TandemConfig, run_dir: Path) -> WeightUpdateMeta:
    return WeightUpdateMeta(
        type=cfg.train.weight_sync,  # type: ignore[arg-type]
        path=str(run_dir / "weights") if cfg.train.weight_sync == "disk" else None,
        bucket_bytes=cfg.train.bucket_mb * 1024**2,
        backend="nccl" if cfg.experiment.device == "cuda" else "gloo",
    )


def run_rl(cfg: TandemConfig) -> RunSummary:
    from transformers import AutoTokenizer

    start_time = time.monotonic()
    run_dir = run_dir_of(cfg)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(to_yaml(cfg))
    tokenizer = AutoTokenizer.from_pretrained(cfg.actor.path)
    data = load_task_data(cfg, tokenizer)
    resume = _read_loop_state(cfg.train.resume_from)
    start_step = resume.get("step", 0)
    summary = RunSummary(run_dir, steps=cfg.train.total_steps)
    metrics = MetricsLogger(run_dir, append=bool(cfg.train.resume_from), tensorboard=cfg.stats.tensorboard,
                            wandb_project=cfg.stats.wandb_project,
                            run_name=f"{cfg.experiment.name}/{cfg.experiment.trial}")
    totals = {"generation": 0.0, "train": 0.0, "sync": 0.0}
    try:
        with LocalScheduler(run_dir) as scheduler:  # logs go to run_dir/logs
            fleet = start_servers(cfg, scheduler, cfg.actor.path)
            workers = start_workers(cfg, scheduler, cfg.actor.path, cfg.train.total_steps * cfg.train.n_minibatches)
            dp = len(workers.call("ping"))
            rollout_cfg = dataclasses.replace(cfg.rollout, servers=fleet.servers)
            with RolloutController(rollout_cfg) as controller:
                workers.call("init_weight_update", weight_update_meta(cfg, run_dir), controller.callback(),
                             verify=cfg.train.verify_weights)
                if cfg.train.resume_from:
                    workers.call("load_state", str(Path(cfg.train.resume_from) / "trainer"))
                    workers.call("update_weights", start_step)  # the fleet serves the resumed weights
                    controller.recover_version(start_step)
                else:
                    controller.set_version(0)
                workflow = RLVRWorkflow(
                    reward_fn=data.task.reward_fn(),
                    params=GenerationParams(max_new_tokens=cfg.gen.max_new_tokens, temperature=cfg.gen.temperature,
                                            top_p=cfg.gen.top_p, top_k=cfg.gen.top_k),
                    n_samples=cfg.gen.n_samples,
                    tokenizer=tokenizer,
                )
                loader = CursorLoader(data.train, cursor=resume.get("cursor", 0))

                def run_eval() -> dict[str, float]:
                    return evaluate(fleet.servers, data.eval, data.task, tokenizer,
                                    max_new_tokens=cfg.gen.max_new_tokens, client_config=rollout_cfg.client_config())

                first = run_eval()
                summary.eval_before = first.get("eval/accuracy")
                metrics.log(start_step, first)
                progress = Progress(cfg.train.total_steps, start_step, enabled=cfg.stats.progress)
                last_eval = first
                for step in range(start_step, cfg.train.total_steps):
                    stats = _rl_step(cfg, controller, workers, workflow, loader, step, dp, totals)
                    done = step + 1
                    if (cfg.train.eval_every and done % cfg.train.eval_every == 0) or done == cfg.train.total_steps:
                        last_eval = run_eval()
                        stats.update(last_eval)
                    metrics.log(done, stats)
                    progress.update(stats, last_eval.get("eval/accuracy"))
                    if cfg.train.save_every and done % cfg.train.save_every == 0:
                        _save_checkpoint(run_dir / "checkpoints" / f"step{done:06d}", workers, done, loader.cursor)
                progress.close()
                summary.eval_after = last_eval.get("eval/accuracy")
                workflow.close()
                workers.call("close_weight_update")
    finally:
        metrics.close()
    summary.seconds = time.monotonic() - start_time
    summary.time_split = totals
    if cfg.stats.plot:
        plot_run(metrics.path, run_dir / "plot.png", title=f"{cfg.experiment.name}/{cfg.experiment.trial}")
    (run_dir / "summary.txt").write_text(summary.describe() + "\n")
    return summary


def _rl_step(cfg: TandemConfig, controller: RolloutController, workers: Any, workflow: RLVRWorkflow,
             loader: CursorLoader, step: int, dp: int, totals: dict[str, float]) -> dict[str, float]:
    """One step; returns its stats. `step` is the weight version the trainer holds before it."""
    t0 = time.monotonic()
    trajs = controller.prepare_batch(loader, workflow)
    t1 = time.monotonic()
    batch, stats = build_training_batch(trajs, cfg.algo, version=step)
    if batch is None or len(batch) < dp:
        # Everything was filtered out (e.g. every group solved): no gradient this step, but the
        # version still advances so the staleness accounting stays exact.
        logger.warning("step %d: %s sequences left after filtering; skipping the update",
                       step + 1, 0 if batch is None else len(batch))
        stats["train/skipped"] = 1.0
    else:
        shards, dispatch_stats = split_for_ranks(batch, dp)
        stats.update(dispatch_stats)
        args = [("tandem.rl.worker_fns:ppo_update", shard, cfg.algo, step, cfg.gen.temperature,
                 cfg.train.n_minibatches) for shard in shards]
        stats.update(workers.call_per_rank("call", args)[0])
    t2 = time.monotonic()
    report = workers.call("update_weights", step + 1)[0]
    t3 = time.monotonic()
    times = {"generation": t1 - t0, "train": t2 - t1, "sync": t3 - t2}
    for key, value in times.items():
        totals[key] += value
    stats.update({f"time/{k}": v for k, v in times.items()})
    stats.update({"sync/seconds": report.seconds, "sync/gb_per_s": report.gb_per_s, "version": float(step + 1)})
    stats.update({f"rollout/{k}": float(v) for k, v in controller.stats().items() if isinstance(v, int | float)})
    return stats


def _save_checkpoint(path: Path, workers: Any, step: int, cursor: int) -> None:
    """Trainer state (DCP) plus the loop's own: step (= weight version) and the data cursor."""
    workers.call("save_state", str(path / "trainer"))
    path.mkdir(parents=True, exist_ok=True)
    tmp = path / f".{LOOP_STATE}.tmp"
    tmp.write_text(json.dumps({"step": step, "cursor": cursor}))
    tmp.replace(path / LOOP_STATE)


def _read_loop_state(resume_from: str | None) -> dict[str, int]:
    if not resume_from:
        return {}
    state = Path(resume_from) / LOOP_STATE
    if not state.is_file():
        from tandem.errors import ConfigError

        raise ConfigError(f"train.resume_from: {resume_from!r} has no {LOOP_STATE}; pass a checkpoint directory "
                          "written by train.save_every (runs/<name>/<trial>/checkpoints/stepNNNNNN)")
    return json.loads(state.read_text())

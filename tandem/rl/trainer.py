"""`tandem train`: asynchronous RL end to end.

One step: the rollout controller hands over the oldest `batch_size` accepted episodes while the
fleet generates ahead (up to the staleness bound); rewards are shaped, groups filtered and
advantages computed on the controller; the batch is split over the data-parallel ranks, each runs
the decoupled PPO update (and the critic its value update); the new weights go to every server,
which bumps the version; stats, evaluation and checkpoints run on their timers. The trial
directory's fate is decided first (`tandem.rl.trial`); progress is reported by `tandem.rl.console`.
See docs/rl.md, "One step"."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tandem.config.loader import to_dict, to_yaml
from tandem.dashboard.record import RunRecorder
from tandem.fleet import ops
from tandem.fleet.generation import GenerationParams
from tandem.fleet.interface import call
from tandem.fleet.routed_experts import RoutedExpertLayout
from tandem.fleet.run_file import ControllerFile, controller_file
from tandem.launch.factory import make_scheduler
from tandem.launch.process_scheduler import ProcessScheduler
from tandem.log_repeats import RepeatCounter
from tandem.rl.batch import build_training_batch
from tandem.rl.checkpoints import TRAINER, LoopState, latest_checkpoint, save_checkpoint
from tandem.rl.cluster import InferenceServers, run_processes, start_servers
from tandem.rl.config import TandemConfig
from tandem.rl.console import attach_run_log
from tandem.rl.data import CursorLoader, TaskData, load_task_data
from tandem.rl.evaluate import check_sandbox, evaluate, reward_function, reward_runner
from tandem.rl.evaluate_agent import evaluate_agent, task_agent
from tandem.rl.faults import kill_point
from tandem.rl.keeper import ServerKeeper
from tandem.rl.metrics import MetricsLogger
from tandem.rl.models import start_models
from tandem.rl.plot import plot_run
from tandem.rl.progress import Progress
from tandem.rl.recording import run_recorder, score_and_record
from tandem.rl.scorers import check_scorers, start_scorers
from tandem.rl.trackers import start_trackers
from tandem.rl.trial import TrialPlan, plan_trial
from tandem.rollout.controller import RolloutController
from tandem.rollout.reward import RewardFn, RewardRunner
from tandem.rollout.workflows.agent import AgentWorkflow
from tandem.rollout.workflows.base import RolloutWorkflow
from tandem.rollout.workflows.build import build_workflow
from tandem.weights.meta import WeightUpdateMeta

logger = logging.getLogger("tandem.run")
_SKIPS = RepeatCounter(logger)  # a filter that empties every batch would warn at every step


class RunInterrupted(Exception):
    """Ctrl-C (or SIGTERM) ended the run; the message says how to continue it."""


@dataclass
class RunSummary:
    run_dir: Path
    start_step: int  # the step this process started from (> 0 when it resumed)
    end_step: int  # the last step completed
    eval_before: float | None = None
    eval_after: float | None = None
    seconds: float = 0.0
    time_split: dict[str, float] = field(default_factory=dict)

    @property
    def steps(self) -> int:
        """Steps this process trained."""
        return self.end_step - self.start_step

    def describe(self) -> str:
        trained = f"steps: {self.steps} in {self.seconds:.0f} s"
        if self.start_step:
            trained = (f"steps: {self.steps} ({self.start_step + 1}-{self.end_step}, resumed at step "
                       f"{self.start_step}) in {self.seconds:.0f} s")
        lines = [f"run directory: {self.run_dir}", trained]
        if self.eval_before is not None and self.eval_after is not None:
            lines.append(
                f"eval accuracy: {self.eval_before:.3f} -> {self.eval_after:.3f} "
                f"({self.eval_after - self.eval_before:+.3f})"
            )
        if self.time_split:
            lines.append("time: " + ", ".join(f"{k} {v:.0f} s" for k, v in self.time_split.items()))
        return "\n".join(lines)


def weight_update_meta(cfg: TandemConfig, run_dir: Path) -> WeightUpdateMeta:
    """The run's weight update: versioned copies (disk sync) and joiners' warm-up copies both go
    to `run_dir/weights`, which launched servers may load from."""
    weights = run_dir / "weights"
    return WeightUpdateMeta(
        type=cfg.train.weight_sync,  # type: ignore[arg-type]
        path=str(weights) if cfg.train.weight_sync == "disk" else None,
        bucket_bytes=cfg.train.bucket_mb * 1024**2,
        backend="nccl" if cfg.experiment.device == "cuda" else "gloo",
        master_address=cfg.cluster.host_ip,
        warmup_dir=str(weights),
        # LoRA: the adapter alone where the servers take adapters over this transport (tandem serve
        # merges it into its base, vLLM over disk serves it through its LoRA support); else merged weights.
        lora_alpha=cfg.actor.lora.alpha if cfg.actor.lora.enabled and cfg.train.weight_sync in
        cfg.rollout.capabilities().adapter_updates else None,
    )


def run_rl(cfg: TandemConfig, plan: TrialPlan | None = None) -> RunSummary:
    """Run (or resume) the trial `plan` describes (default: `plan_trial(cfg)`); raises
    `RunInterrupted` on Ctrl-C after everything it started is gone."""
    from transformers import AutoTokenizer  # transformers: seconds

    start_time = time.monotonic()
    check_sandbox(cfg)  # before anything starts or is written
    check_scorers(cfg)
    plan = plan or plan_trial(cfg)
    plan.prepare()
    run_dir = plan.run_dir
    attach_run_log(run_dir)
    (run_dir / "config.yaml").write_text(to_yaml(cfg))
    summary = RunSummary(run_dir, start_step=plan.start_step, end_step=plan.start_step)
    runner = reward_runner(cfg)
    metrics: MetricsLogger | None = None
    trained = False
    try:
        logger.info("loading the tokenizer and the %s task (%d train / %d eval items)", cfg.task.name,
                    cfg.task.train_size, cfg.task.eval_size)
        tokenizer = AutoTokenizer.from_pretrained(cfg.actor.path)
        data = load_task_data(cfg, tokenizer)
        reward_fn = reward_function(cfg, data.task)
        workflow = workflow_for(cfg, tokenizer, reward_fn, runner)  # before anything starts
        task = RunTask(data, tokenizer, reward_fn, runner, workflow)
        trackers = start_trackers(cfg.stats, run_dir, name=f"{cfg.experiment.name}/{cfg.experiment.trial}",
                                  experiment=cfg.experiment.name, config=to_dict(cfg))
        metrics = MetricsLogger(run_dir, resume_step=plan.start_step if plan.resume_from else None,
                                tensorboard=cfg.stats.tensorboard, trackers=trackers)
        with make_scheduler(cfg.scheduler, run_dir, host=cfg.cluster.host_ip,
                            processes=run_processes(cfg)) as scheduler:  # logs: run_dir/logs
            try:
                _train(Run(cfg, plan, scheduler, task, summary), metrics)
            except Exception:
                scheduler.log_exits()  # a role that died says so, with its log
                raise
        trained = True
    except KeyboardInterrupt:
        raise RunInterrupted(_resume_hint(cfg, run_dir, summary.end_step)) from None
    finally:
        runner.close()
        if metrics is not None and not trained:
            metrics.close(failed=True)
    outputs = [run_dir / "plot.png", run_dir / "summary.txt"]
    try:
        summary.seconds = time.monotonic() - start_time
        if cfg.stats.plot:
            plot_run(metrics.path, outputs[0], title=f"{cfg.experiment.name}/{cfg.experiment.trial}")
        outputs[1].write_text(summary.describe() + "\n")
    finally:  # the trackers get the plot and the summary as artifacts
        metrics.close(artifacts=outputs)
    return summary


def _train(run: Run, metrics: MetricsLogger) -> None:
    """The loop: evaluate; each step, log, then evaluate and checkpoint on their timers (evaluation
    also after the last step); then `finish`."""
    cfg, summary = run.cfg, run.summary
    with run:
        last_eval = run.evaluate(summary.start_step)
        summary.eval_before = last_eval.get("eval/accuracy")
        if not metrics.has_step(summary.start_step):  # a resumed trial keeps the row it had for this step
            metrics.log(summary.start_step, last_eval)
        with Progress(cfg.train.total_steps, summary.start_step, enabled=cfg.stats.progress) as progress:
            for step in range(summary.start_step, cfg.train.total_steps):
                stats = run.step(step)
                done = summary.end_step = step + 1
                last = done == cfg.train.total_steps
                if last or (cfg.train.eval_every and done % cfg.train.eval_every == 0):
                    last_eval = run.evaluate(done)
                    stats.update(last_eval)
                metrics.log(done, stats)
                progress.update(stats, last_eval.get("eval/accuracy"))
                if cfg.train.save_every and (last or done % cfg.train.save_every == 0):
                    run.checkpoint(done)
        summary.eval_after = last_eval.get("eval/accuracy")
        run.finish()


@dataclass
class RunTask:
    """What a run learns from, loaded before anything starts."""

    data: TaskData
    tokenizer: Any
    reward_fn: RewardFn
    runner: RewardRunner
    workflow: RolloutWorkflow


class Run:
    """One launched run. Entering it starts the servers, the trainer models and the rollout
    controller (every resource in one `ExitStack`, released in reverse on exit) and brings the
    fleet to the trainer's version; then `evaluate`, `step`, `checkpoint` and `finish` drive it."""

    def __init__(self, cfg: TandemConfig, plan: TrialPlan, scheduler: ProcessScheduler, task: RunTask,
                 summary: RunSummary):
        self.cfg, self.plan, self.scheduler, self.task, self.summary = cfg, plan, scheduler, task, summary
        self._stack = contextlib.ExitStack()
        frontier = plan.loop.frontier
        self.loader = CursorLoader(task.data.train, cursor=frontier.next_index, skip=frontier.resolved)
        self.eval_agent = task_agent(task.data.task, task.tokenizer, cfg.gen.max_new_tokens)
        summary.time_split = {"generation": 0.0, "train": 0.0, "sync": 0.0}
        self.recorder: RunRecorder | None = None

    def __enter__(self) -> Run:
        with self._stack as stack:
            self._start(stack)
            self._stack = stack.pop_all()  # started: the resources now live until __exit__
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()

    def _start(self, stack: contextlib.ExitStack) -> None:
        cfg, plan, scheduler = self.cfg, self.plan, self.scheduler
        meta = weight_update_meta(cfg, plan.run_dir)
        Path(meta.warmup_dir).mkdir(parents=True, exist_ok=True)
        servers = start_servers(cfg, scheduler, cfg.actor.path, weights_dir=Path(meta.warmup_dir))
        scorers = start_scorers(cfg, scheduler, self.task.tokenizer)
        self.models = start_models(cfg, scheduler)
        self.trainer = self.models.actor
        if cfg.scheduler.remote:  # trainer rank 0 hosts the weight-update group wherever it was placed
            meta = dataclasses.replace(meta, master_address=self.trainer.group.hosts[0])
        for role, where in scheduler.placement():
            logger.info("placement: %s -> %s", role, where)
        # Trainer rank 0 reaches the callback server from wherever the scheduler placed it.
        callback_host = cfg.cluster.host_ip if cfg.scheduler.remote else cfg.rollout.callback_host
        self.rollout_cfg = dataclasses.replace(cfg.rollout, servers=servers.addresses, api_key=servers.api_key,
                                               callback_host=callback_host)
        # Released in reverse: the workflow (an agent workflow's proxies stop while their loops still
        # run), the controller file, the keeper, then the controller, which cancels and awaits
        # in-flight episodes and their reward calls before the reward pool closes.
        self.controller = stack.enter_context(RolloutController(self.rollout_cfg, routed_expert_layout=routed_expert_layout(cfg),
                                                                scorers=scorers))
        stack.enter_context(_keep_servers(cfg, scheduler, self.controller, servers))
        stack.enter_context(controller_file(plan.run_dir, ControllerFile(
            self.controller.callback_address(), self.controller.join_token, servers.api_key, os.getpid())))
        stack.enter_context(contextlib.closing(self.task.workflow))
        self.recorder = stack.enter_context(run_recorder(cfg, plan.run_dir, self.task.tokenizer, self.controller.members,
                                                         servers.api_key, plan.start_step if plan.resume_from else None))
        self.trainer.init_weight_update(meta, self.controller.callback(), verify=cfg.train.verify_weights)
        if plan.resume_from is not None:
            self._resume(plan.resume_from, plan.start_step)
        elif meta.lora_alpha is not None or cfg.actor.lora.path:
            # The servers start from actor.path: a vLLM server in LoRA mode serves no adapter until one
            # is loaded, and an adapter the trainer starts from (actor.lora.path) is not in actor.path.
            self.trainer.update_weights(0)
        else:
            call(self.controller, ops.SET_VERSION, ops.SetVersion(0))

    def _resume(self, checkpoint: Path, step: int) -> None:
        began = time.monotonic()
        self.models.load(checkpoint / TRAINER)
        self.trainer.update_weights(step)  # the fleet serves the resumed weights, before any rollout
        frontier = self.plan.loop.frontier
        self.controller.recover_version(step, frontier)
        logger.info("resumed at step %d from %s in %.1f s (the stream continues at item %d)", step,
                    checkpoint, time.monotonic() - began, frontier.next_index)

    def evaluate(self, step: int) -> dict[str, float]:
        """Eval accuracy of the weights of `step`; an agent (the run's, or a tool task's own) is
        evaluated greedily through its proxy, on its reward."""
        began = time.monotonic()
        task, client_config = self.task, self.rollout_cfg.client_config()
        agent = task.workflow if isinstance(task.workflow, AgentWorkflow) else self.eval_agent
        if agent is not None:
            stats = evaluate_agent(self.controller.pool, task.data.eval, agent, client_config=client_config)
        else:
            stats = evaluate(self.controller.pool, task.data.eval, task.reward_fn, task.runner, task.tokenizer,
                             max_new_tokens=self.cfg.gen.max_new_tokens, client_config=client_config)
        if stats:
            logger.info("step %d: eval accuracy %.3f on %d items (%.1f s)", step, stats["eval/accuracy"],
                        int(stats["eval/n"]), time.monotonic() - began)
        return stats

    def step(self, step: int) -> dict[str, float]:
        """One step; returns its stats. `step` is the weight version the trainer holds before it."""
        cfg, controller, models, trainer = self.cfg, self.controller, self.models, self.trainer
        dp = max(trainer.dp_size, models.critic.dp_size if models.critic is not None else 1)
        t0 = time.monotonic()
        kill_point("rollout", step + 1, delay_s=0.05)
        trajs = controller.prepare_batch(self.loader, self.task.workflow)
        t1 = time.monotonic()
        batch, stats = build_training_batch(trajs, cfg.algo, version=step)
        if self.recorder is not None:  # before the update: the trainer scores at the step's weights
            stats.update(score_and_record(self.recorder, cfg, trainer, step + 1, step, trajs))
        stats["data/prompt_ids"] = sorted({t.stream_index for t in trajs})  # type: ignore[assignment]
        if batch is None or len(batch) < dp:
            # Everything was filtered out (e.g. every group solved): no gradient this step, but the
            # version still advances so the staleness accounting stays exact.
            _SKIPS.log("skip", f"step {step + 1}: {0 if batch is None else len(batch)} sequences left after "
                               f"filtering (fewer than the {dp} trainer rank(s)); skipping the update")
            stats["train/skipped"] = 1.0
        else:
            kill_point("train", step + 1, delay_s=0.05)
            stats.update(models.update(batch, cfg, step))
        t2 = time.monotonic()
        kill_point("sync", step + 1, delay_s=0.02)
        report = trainer.update_weights(step + 1)
        t3 = time.monotonic()
        times = {"generation": t1 - t0, "train": t2 - t1, "sync": t3 - t2}
        for key, value in times.items():
            self.summary.time_split[key] += value
        stats.update({f"time/{k}": v for k, v in times.items()})
        stats.update({"sync/seconds": report.seconds, "sync/gb_per_s": report.gb_per_s, "sync/mb": report.bytes / 1e6,
                      "version": float(step + 1)})
        stats.update({f"rollout/{k}": float(v) for k, v in controller.stats().items() if isinstance(v, int | float)})
        stats.update(controller.step_metrics())
        stats.update({"sync/servers": float(len(report.servers)), "sync/attempts": float(report.attempts)})
        return stats

    def finish(self) -> None:
        """After the last step: the trainer ranks release their weight-update group."""
        self.trainer.close_weight_update()

    def checkpoint(self, step: int) -> None:
        """The trained models' state (DCP: the actor's, the critic's) and the loop's (step = weight
        version, the stream's frontier), written whole, then made LATEST (`tandem.rl.checkpoints`)."""
        began = time.monotonic()
        state = LoopState(step, self.controller.frontier(), self.cfg.experiment.seed)

        def save_trainer(directory: Path) -> None:
            self.models.save(directory)
            kill_point("checkpoint", step)  # fault injection: a save cut short after the trainer's part

        path = save_checkpoint(self.plan.run_dir, state, save_trainer, keep=self.cfg.train.keep_checkpoints)
        logger.info("step %d: checkpoint %s (%.1f s)", step, path, time.monotonic() - began)


def workflow_for(cfg: TandemConfig, tokenizer: Any, reward_fn: RewardFn, runner: RewardRunner) -> RolloutWorkflow:
    """The run's workflow (`rollout.workflow`, `build_workflow`): `gen.*` sampling, `gen.n_samples`
    per item, requests seeded from `experiment.seed` under `rollout.seed_sampling`."""
    gen = cfg.gen
    params = GenerationParams(max_new_tokens=gen.max_new_tokens, temperature=gen.temperature, top_p=gen.top_p,
                              top_k=gen.top_k)
    return build_workflow(cfg.rollout, tokenizer, reward_fn, runner, params=params, n_samples=gen.n_samples,
                          seed=cfg.experiment.seed)


def routed_expert_layout(cfg: TandemConfig) -> RoutedExpertLayout | None:
    """The routes rollouts ask the servers for: a MoE model's whenever r3 replays them, and with
    tandem servers (which record them anyway) for `moe/route_agreement` in every mode; None for a
    dense model, and for other servers without r3 (an SGLang server returns them only when started
    with --enable-return-routed-experts)."""
    if cfg.actor.router_replay != "r3" and cfg.rollout.server_kind != "tandem":
        return None
    return RoutedExpertLayout.of_model(cfg.actor.path)


def _keep_servers(cfg: TandemConfig, scheduler: ProcessScheduler, controller: RolloutController,
                  servers: InferenceServers) -> contextlib.AbstractContextManager:
    """Evict launched servers the moment they exit (and replace them with `rollout.replace_dead`);
    launched vLLM servers are not watched (the keeper restarts `tandem serve`)."""
    if not servers.launched or cfg.rollout.server_kind != "tandem":
        return contextlib.nullcontext()
    return ServerKeeper(scheduler, controller, servers.handles, model_path=cfg.actor.path,
                        server_args=servers.server_args, device=cfg.experiment.device, api_key=servers.api_key,
                        replace_dead=cfg.rollout.replace_dead)


def _resume_hint(cfg: TandemConfig, run_dir: Path, step: int) -> str:
    latest = latest_checkpoint(run_dir)
    head = f"interrupted after step {step} of {cfg.train.total_steps}."
    if latest is not None:
        return (f"{head} The latest checkpoint is {latest}: run the same command again to resume from it "
                "(steps after it are redone).")
    why = ("train.save_every=0; set it to make runs resumable" if not cfg.train.save_every
           else f"the first comes at step {cfg.train.save_every}")
    return (f"{head} No checkpoint was saved ({why}). To start again, run the same command with "
            "train.overwrite=true, or with a new experiment.trial.")


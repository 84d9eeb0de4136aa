"""`tandem sft`: supervised warm start on a task's reference completions, with the same engine.

Loss on the assistant turns of each reference conversation only (for a single-turn task: the
completion); the batch is split across the trainer ranks like RL batches; the result is an HF
directory (with `actor.lora`: the PEFT adapter, which `tandem train actor.lora.path=...` continues),
evaluated greedily by one inference server at the end (a tool-using task such as
`calculator` by its own agent through the agent proxy: `tandem.rl.evaluate_agent`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tandem.config.loader import to_dict, to_yaml
from tandem.data.batch import SequenceBatch
from tandem.data.tasks.chat import sft_example
from tandem.launch.factory import make_scheduler
from tandem.launch.process_scheduler import ProcessScheduler
from tandem.models.lora_export import export_merged
from tandem.rl.cluster import run_processes, start_workers
from tandem.rl.config import SFTRunConfig
from tandem.rl.data import CursorLoader, TaskData, load_task_data
from tandem.rl.dispatch import model_hidden_size, split_for_ranks
from tandem.rl.evaluate import check_sandbox, evaluate, reward_function, reward_runner
from tandem.rl.evaluate_agent import evaluate_agent, task_agent
from tandem.rl.metrics import MetricsLogger
from tandem.rl.trackers import start_trackers
from tandem.rl.trial import run_dir_of
from tandem.rollout.reward import RewardRunner


def run_sft(cfg: SFTRunConfig) -> tuple[Path, dict[str, float]]:
    """Train, save, evaluate; returns the HF directory and the eval stats (empty when
    `task.eval_size` is 0: then no inference server is started). For `sft.objective=lm`;
    `tandem.rl.reward_sft` trains a reward model."""
    from tqdm import tqdm
    from transformers import AutoTokenizer

    if cfg.task.eval_size:  # the evaluation's reward may run code: before anything is written
        check_sandbox(cfg)
    run_dir, out = sft_outputs(cfg)
    tokenizer = AutoTokenizer.from_pretrained(cfg.actor.path)
    data = load_task_data(cfg, tokenizer)
    used = data.train[: cfg.sft.steps * cfg.sft.batch_size]  # the stream never reaches further items
    examples = CursorLoader([sft_example(item, tokenizer, data.task, cfg.task.system_prompt) for item in used])
    metrics = sft_metrics(cfg, run_dir)
    runner = reward_runner(cfg)
    failed = True
    try:
        with make_scheduler(cfg.scheduler, run_dir, host=cfg.cluster.host_ip,
                            processes=run_processes(cfg)) as scheduler:  # logs: run_dir/logs
            trainer = start_workers(cfg, scheduler)
            hidden_size = model_hidden_size(cfg.actor.path)
            for step in tqdm(range(cfg.sft.steps), desc="sft", unit="step", disable=not cfg.stats.progress):
                chunk = [next(examples) for _ in range(cfg.sft.batch_size)]
                batch = SequenceBatch.from_token_lists(
                    [e["input_ids"] for e in chunk], loss_mask=[e["loss_mask"] for e in chunk]
                )
                shards, dispatch = split_for_ranks(batch, trainer.dp_size, cfg.actor.balance, hidden_size)
                metrics.log(step + 1, {**trainer.sft_step(shards), **dispatch}, phase="sft")
            trainer.save_hf(str(out), tokenizer_dir=cfg.actor.path, overwrite=True)
            trainer.shutdown()
            result: dict[str, float] = {}
            if data.eval:  # task.eval_size=0: no evaluation, so no server is started for one
                result = _evaluate_saved(cfg, scheduler, out, data, tokenizer, runner)
                metrics.log(cfg.sft.steps, result, phase="sft")
        failed = False
    finally:
        runner.close()
        metrics.close(failed=failed)
    return out, result


def sft_outputs(cfg: SFTRunConfig) -> tuple[Path, Path]:
    """(the run directory, made, with the config written to sft-config.yaml; the HF directory the
    model goes to: `sft.output`, else the run directory's `sft`)."""
    run_dir = run_dir_of(cfg)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "sft-config.yaml").write_text(to_yaml(cfg))
    return run_dir, Path(cfg.sft.output) if cfg.sft.output else run_dir / "sft"


def sft_metrics(cfg: SFTRunConfig, run_dir: Path) -> MetricsLogger:
    """sft-metrics.jsonl (and sft-tensorboard/) in the run directory; the trackers `stats.*` asks
    for get a run named `name/trial/sft` with the config and the same rows."""
    trackers = start_trackers(cfg.stats, run_dir, name=f"{cfg.experiment.name}/{cfg.experiment.trial}/sft",
                              experiment=cfg.experiment.name, config=to_dict(cfg))
    return MetricsLogger(run_dir, filename="sft-metrics.jsonl", tensorboard=cfg.stats.tensorboard,
                         tensorboard_dir="sft-tensorboard", trackers=trackers)


def _evaluate_saved(cfg: SFTRunConfig, scheduler: ProcessScheduler, out: Path, data: TaskData, tokenizer: Any,
                    runner: RewardRunner) -> dict[str, float]:
    """Greedy eval of the saved model `out` on one inference server started for it (a tool task:
    by the task's agent). A LoRA adapter is served merged into its base (`sft-merged` beside it)."""
    if cfg.actor.lora.enabled:
        out = export_merged(cfg.actor.path, out, out.parent / f"{out.name}-merged", overwrite=True)
    server = scheduler.start_servers(1, out, server_args=cfg.rollout.server_args, name="sft-eval")[0]
    agent = task_agent(data.task, tokenizer, cfg.gen.max_new_tokens)
    if agent is not None:
        return evaluate_agent([server.url], data.eval, agent, client_config=cfg.rollout.client_config())
    return evaluate([server.url], data.eval, reward_function(cfg, data.task), runner, tokenizer,
                    max_new_tokens=cfg.gen.max_new_tokens, client_config=cfg.rollout.client_config())

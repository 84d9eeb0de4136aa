"""Evaluation: greedy answers to the eval items over the fleet, scored by the run's reward function
in the run's reward pool, like training rewards (worker processes, a timeout each).

An item whose generation or reward fails counts as wrong: the accuracy is over every item asked
for, and `eval/failed` says how many failed. Each distinct error is logged once, then counted.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, cast

from tandem import aio
from tandem.data.tasks import Task, get_task
from tandem.errors import ConfigError, SandboxUnavailable
from tandem.fleet.generation import GenerationParams
from tandem.log_repeats import RepeatCounter
from tandem.rl.config import TandemConfig
from tandem.rollout.client import ClientConfig, InferenceClient
from tandem.rollout.pool import ServerPool
from tandem.rollout.reward import RewardFn, RewardRunner, wants_sandbox
from tandem.rollout.types import ModelRequest
from tandem.rollout.workflows.rlvr import reward_fields
from tandem.sandbox.availability import require
from tandem.user_code import UserFunction

logger = logging.getLogger(__name__)


async def _evaluate(client: InferenceClient, items: list[dict[str, Any]], reward_fn: RewardFn,
                    runner: RewardRunner, tokenizer: Any, max_new_tokens: int, concurrency: int) -> dict[str, float]:
    params = GenerationParams(max_new_tokens=max_new_tokens, temperature=0.0)
    gate = asyncio.Semaphore(concurrency)
    errors = RepeatCounter(logger)

    async def one(item: dict[str, Any]) -> tuple[float, int, bool]:
        try:
            async with gate:
                resp = await client.agenerate(ModelRequest(list(item["input_ids"]), params))
            text = tokenizer.decode(resp.output_ids, skip_special_tokens=True)
            result = await runner.ascore(reward_fn, item.get("prompt", ""), text, item["input_ids"], resp.output_ids,
                                         **reward_fields(item))
            error = result.error
        except Exception as exc:  # generation failed (deadline, a server refusing): the item is wrong
            resp, error = None, f"{type(exc).__name__}: {exc}"
        if error is not None:
            errors.log(error, f"eval item {item.get('id', '?')} counts as wrong: {error}")
            return 0.0, 0 if resp is None else len(resp.output_ids), True
        return float(result.value), len(resp.output_ids), False

    try:
        async with asyncio.TaskGroup() as tg:
            tasks = [tg.create_task(one(item)) for item in items]
    finally:
        await client.aclose()
    results = [t.result() for t in tasks]
    failed = sum(f for _, _, f in results)
    if failed:
        errors.flush()
        logger.warning("eval: %d of %d items failed and count as wrong (errors above)", failed, len(results))
    n = max(1, len(results))
    return {"eval/accuracy": sum(r for r, _, _ in results) / n, "eval/response_len": sum(L for _, L, _ in results) / n,
            "eval/n": float(len(results)), "eval/failed": float(failed)}


def reward_runner(cfg: TandemConfig) -> RewardRunner:
    """The run's reward pool, for training and evaluation: `task.reward_workers` processes, each
    call under `task.reward_timeout_s`, each worker's sandbox with `rollout.sandbox`'s limits."""
    return RewardRunner(max_workers=cfg.task.reward_workers, timeout_s=cfg.task.reward_timeout_s,
                        timeout_key="task.reward_timeout_s", sandbox=cfg.rollout.sandbox)


def check_sandbox(cfg: TandemConfig) -> None:
    """A reward that runs code (it has a `sandbox` parameter: the code task's, or a rollout.reward's)
    needs isolation on this host: checked before anything starts, a ConfigError saying why not."""
    if not wants_sandbox(reward_function(cfg, get_task(cfg.task.name, **dict(cfg.task.options)))):
        return
    try:
        require(cfg.rollout.sandbox)
    except SandboxUnavailable as exc:
        which = f"rollout.reward {cfg.rollout.reward!r}" if cfg.rollout.reward else f"the {cfg.task.name} task's reward"
        raise ConfigError(f"{which} runs code in the sandbox, which cannot run here: {exc}") from None


def reward_function(cfg: TandemConfig, task: Task) -> RewardFn:
    """The run's reward, for training and evaluation alike: `rollout.reward` when set (checked
    when the config was loaded), as a `UserFunction` that pickles by its spec into the reward
    workers (a function from a file could not be pickled by reference), else the task's own."""
    if cfg.rollout.reward:
        return cast(RewardFn, UserFunction(cfg.rollout.reward))
    return task.reward_fn()


def evaluate(servers: list[str] | ServerPool, items: list[dict[str, Any]], reward_fn: RewardFn, runner: RewardRunner,
             tokenizer: Any, *, max_new_tokens: int, client_config: ClientConfig,
             concurrency: int = 64) -> dict[str, float]:
    """Mean reward of greedy completions (the accuracy, for 0/1 task rewards); runs on its own event
    loop and client, next to the rollout executor (the servers batch both)."""
    if not items:
        return {}
    client = InferenceClient(servers if isinstance(servers, ServerPool) else list(servers), client_config)
    return aio.run(_evaluate(client, items, reward_fn, runner, tokenizer, max_new_tokens, concurrency))

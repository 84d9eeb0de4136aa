"""Evaluation: greedy answers to the eval items over the fleet, scored by the run's reward function
in the run's reward pool, like training rewards (worker processes, a timeout each).

A tool-using task (the calculator) is evaluated by the reference tool loop instead of one
generation (`ToolLoop`, `tandem.rl.tool_eval`).

An item whose generation or reward fails counts as wrong: the accuracy is over every item asked
for, and `eval/failed` says how many failed. Each distinct error is logged once, then counted.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any, cast

from tandem import aio
from tandem.data.tasks import Task
from tandem.fleet.generation import GenerationParams
from tandem.log_repeats import RepeatCounter
from tandem.rl.config import TandemConfig
from tandem.rl.tool_eval import ToolRunner, tool_episode
from tandem.rollout.client import ClientConfig, InferenceClient
from tandem.rollout.pool import ServerPool
from tandem.rollout.reward import RewardFn, RewardRunner
from tandem.rollout.types import ModelRequest
from tandem.rollout.workflows.rlvr import reward_fields

logger = logging.getLogger(__name__)


async def _evaluate(client: InferenceClient, items: list[dict[str, Any]], reward_fn: RewardFn,
                    runner: RewardRunner, tokenizer: Any, max_new_tokens: int, concurrency: int,
                    tools: ToolLoop | None = None) -> dict[str, float]:
    params = GenerationParams(max_new_tokens=max_new_tokens, temperature=0.0)
    gate = asyncio.Semaphore(concurrency)
    errors = RepeatCounter(logger)

    async def answer(item: dict[str, Any]) -> tuple[str, list[int], int, dict[str, float]]:
        """(answer text, its ids, tokens generated, tool-loop stats) of one item."""
        if tools is None:
            resp = await client.agenerate(ModelRequest(list(item["input_ids"]), params))
            return tokenizer.decode(resp.output_ids, skip_special_tokens=True), resp.output_ids, len(resp.output_ids), {}
        ep = await tool_episode(client, item, tokenizer, params, tools.call_tool, tools.max_turns, tools.system_prompt)
        stats = {"tool_call_first_turn": float(ep.first_turn_call), "malformed_tool_call": float(ep.malformed),
                 "answered": float(ep.answered), "turns": float(ep.turns), "tool_calls": float(ep.calls)}
        return ep.answer, ep.answer_ids, ep.generated, stats

    async def one(item: dict[str, Any]) -> tuple[float, int, bool, dict[str, float]]:
        length, stats = 0, {}
        try:
            async with gate:
                text, ids, length, stats = await answer(item)
            result = await runner.ascore(reward_fn, item.get("prompt", ""), text, item["input_ids"], ids,
                                         **reward_fields(item))
            error = result.error
        except Exception as exc:  # generation failed (deadline, a server refusing): the item is wrong
            error = f"{type(exc).__name__}: {exc}"
        if error is not None:
            errors.log(error, f"eval item {item.get('id', '?')} counts as wrong: {error}")
            return 0.0, length, True, stats
        return float(result.value), length, False, stats

    try:
        async with asyncio.TaskGroup() as tg:
            tasks = [tg.create_task(one(item)) for item in items]
    finally:
        await client.aclose()
    results = [t.result() for t in tasks]
    failed = sum(f for _, _, f, _ in results)
    if failed:
        errors.flush()
        logger.warning("eval: %d of %d items failed and count as wrong (errors above)", failed, len(results))
    n = max(1, len(results))
    out = {"eval/accuracy": sum(r for r, _, _, _ in results) / n,
           "eval/response_len": sum(L for _, L, _, _ in results) / n,
           "eval/n": float(len(results)), "eval/failed": float(failed)}
    for key in sorted({k for _, _, _, s in results for k in s}):
        out[f"eval/{key}"] = sum(s.get(key, 0.0) for _, _, _, s in results) / n
    return out


@dataclass
class ToolLoop:
    """Evaluate by the reference tool loop (`tandem.rl.tool_eval`) instead of one generation."""

    call_tool: ToolRunner
    max_turns: int = 4
    system_prompt: str | None = None


def tool_loop_of(task: Task, system_prompt: str | None = None) -> ToolLoop | None:
    """The tool loop of a tool-using task (one with `call_tool`), else None (single-turn eval)."""
    call_tool = getattr(task, "call_tool", None)
    return ToolLoop(call_tool, system_prompt=system_prompt) if callable(call_tool) else None


def reward_function(cfg: TandemConfig, task: Task) -> RewardFn:
    """The run's reward, for training and evaluation alike: `rollout.reward` when set (checked
    when the config was loaded), as a `UserFunction` that pickles by its spec into the reward
    workers (a function from a file could not be pickled by reference), else the task's own."""
    if cfg.rollout.reward:
        from tandem.user_code import UserFunction

        return cast(RewardFn, UserFunction(cfg.rollout.reward))
    return task.reward_fn()


def evaluate(servers: list[str] | ServerPool, items: list[dict[str, Any]], reward_fn: RewardFn, runner: RewardRunner,
             tokenizer: Any, *, max_new_tokens: int, client_config: ClientConfig,
             concurrency: int = 64, tools: ToolLoop | None = None) -> dict[str, float]:
    """Mean reward of greedy completions (the accuracy, for 0/1 task rewards); runs on its own event
    loop and client, next to the rollout executor (the servers batch both). With `tools`, each item
    is a greedy run of the tool loop (`max_new_tokens` per generation) and its answer is scored; the
    stats add the share of items whose first turn was a well-formed tool call, that had a malformed
    call, that answered, and the mean generations and tool calls per item."""
    if not items:
        return {}
    client = InferenceClient(servers if isinstance(servers, ServerPool) else list(servers), client_config)
    return aio.run(_evaluate(client, items, reward_fn, runner, tokenizer, max_new_tokens, concurrency, tools))

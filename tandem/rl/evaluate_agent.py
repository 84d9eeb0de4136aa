"""Evaluation of an agent workflow (`rollout.workflow=agent`, or a tool-using task's own agent): each eval item once, greedy, through the agent proxy; the
accuracy is the mean of the rewards the agent returned (a failed or timed-out run counts as 0 and
in `eval/failed`, each distinct error logged once)."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from typing import Any

from tandem import aio
from tandem.agents import agent_for_task
from tandem.data.tasks import Task
from tandem.fleet.generation import GenerationParams
from tandem.log_repeats import RepeatCounter
from tandem.rollout.client import ClientConfig, InferenceClient
from tandem.rollout.pool import ServerPool
from tandem.rollout.workflows.agent import AgentWorkflow

logger = logging.getLogger(__name__)


async def _evaluate(client: InferenceClient, items: list[dict[str, Any]], workflow: AgentWorkflow,
                    concurrency: int) -> dict[str, float]:
    params = dataclasses.replace(workflow.params, temperature=0.0, top_p=1.0, top_k=-1, seed=None)
    gate = asyncio.Semaphore(concurrency)
    errors = RepeatCounter(logger)
    proxy = await workflow.proxy(client)

    async def one(item: dict[str, Any]) -> tuple[float, int, int, bool]:
        try:
            async with gate:
                reward, tokens, calls = await workflow.score_once(proxy, item, params)
            return reward, tokens, calls, False
        except Exception as exc:
            errors.log(f"{type(exc).__name__}: {exc}", f"eval item {item.get('id', '?')} counts as wrong: {exc}")
            return 0.0, 0, 0, True

    try:
        async with asyncio.TaskGroup() as tg:
            tasks = [tg.create_task(one(item)) for item in items]
    finally:
        await workflow.aclose_proxy()
        await client.aclose()
    results = [t.result() for t in tasks]
    failed = sum(r[3] for r in results)
    if failed:
        errors.flush()
        logger.warning("eval: %d of %d agent runs failed and count as wrong (errors above)", failed, len(results))
    n = max(1, len(results))
    return {"eval/accuracy": sum(r[0] for r in results) / n, "eval/response_len": sum(r[1] for r in results) / n,
            "eval/calls": sum(r[2] for r in results) / n, "eval/n": float(len(results)), "eval/failed": float(failed)}


def task_agent(task: Task, tokenizer: Any, max_new_tokens: int) -> AgentWorkflow | None:
    """The workflow that evaluates a tool-using task by its own agent (`agent_for_task`), else None."""
    agent = agent_for_task(task.name)
    if agent is None:
        return None
    return AgentWorkflow(agent, tokenizer, GenerationParams(max_new_tokens=max_new_tokens), n_samples=1)


def evaluate_agent(servers: list[str] | ServerPool, items: list[dict[str, Any]], workflow: AgentWorkflow, *,
                   client_config: ClientConfig, concurrency: int = 32) -> dict[str, float]:
    """Mean reward of greedy agent runs, on its own event loop, client and proxy."""
    if not items:
        return {}
    client = InferenceClient(servers if isinstance(servers, ServerPool) else list(servers), client_config)
    return aio.run(_evaluate(client, items, workflow, concurrency))

"""Evaluation: greedy answers to the eval items, scored by the task's reward, over the fleet."""

from __future__ import annotations

import asyncio
from typing import Any

from tandem import aio
from tandem.data.tasks import Task
from tandem.rollout.client import ClientConfig, InferenceClient
from tandem.rollout.types import GenerationParams, ModelRequest


async def _evaluate(client: InferenceClient, items: list[dict[str, Any]], task: Task, tokenizer: Any,
                    max_new_tokens: int, concurrency: int) -> dict[str, float]:
    params = GenerationParams(max_new_tokens=max_new_tokens, temperature=0.0)
    gate = asyncio.Semaphore(concurrency)

    async def one(item: dict[str, Any]) -> tuple[float, int]:
        async with gate:
            resp = await client.agenerate(ModelRequest(list(item["input_ids"]), params))
        text = tokenizer.decode(resp.output_ids, skip_special_tokens=True)
        return task.reward(text, item), len(resp.output_ids)

    try:
        results = await asyncio.gather(*(one(item) for item in items))
    finally:
        await client.aclose()
    n = max(1, len(results))
    return {"eval/accuracy": sum(r for r, _ in results) / n, "eval/response_len": sum(L for _, L in results) / n,
            "eval/n": float(len(results))}


def evaluate(servers: list[str], items: list[dict[str, Any]], task: Task, tokenizer: Any, *,
             max_new_tokens: int, client_config: ClientConfig, concurrency: int = 64) -> dict[str, float]:
    """Accuracy (mean task reward) of greedy completions; runs on its own event loop and client,
    next to the rollout executor (the servers batch both)."""
    if not items:
        return {}
    client = InferenceClient(list(servers), client_config)
    return aio.run(_evaluate(client, items, task, tokenizer, max_new_tokens, concurrency))

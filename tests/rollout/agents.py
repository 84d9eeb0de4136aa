"""Agent functions for the agent workflow tests (imported by path: `tests.rollout.agents:NAME`)."""

from __future__ import annotations

import asyncio
from typing import Any


async def three_turns(client: Any, item: dict[str, Any]) -> float:
    """Asks, then follows up twice; the reward is the number of characters it got back, capped."""
    messages = list(item["messages"])
    got = 0
    for turn in range(3):
        reply = await client.chat.completions.create(model="policy", messages=messages)
        message = reply.choices[0].message
        got += len(message.content or "")
        messages += [message.model_dump(exclude_none=True), {"role": "user", "content": f"and then {turn}?"}]
    return min(1.0, got / 100)


async def per_call(client: Any, item: dict[str, Any]) -> dict[str, float]:
    """Two independent calls (two chains), rewarded by call id."""
    first = await client.chat.completions.create(model="policy", messages=item["messages"])
    second = await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "other"}])
    return {first.id: 0.25, second.id: 0.75}


async def broken(client: Any, item: dict[str, Any]) -> float:
    await client.chat.completions.create(model="policy", messages=item["messages"])
    raise ValueError(f"no answer for {item['id']}")


async def sleepy(client: Any, item: dict[str, Any]) -> float:
    await asyncio.sleep(3600)
    return 1.0


async def wordy(client: Any, item: dict[str, Any]) -> str:
    await client.chat.completions.create(model="policy", messages=item["messages"])
    return "great"


def not_async(client: Any, item: dict[str, Any]) -> float:
    return 1.0


async def sdk_calculator(client: Any, item: dict[str, Any]) -> float:
    """An agent written with OpenAI's Agents SDK (tracing off: nothing leaves the machine)."""
    from agents import Agent, OpenAIChatCompletionsModel, Runner, function_tool, set_tracing_disabled

    set_tracing_disabled(True)

    @function_tool
    def calculator(expression: str) -> str:
        """Evaluate an arithmetic expression."""
        left, _, right = expression.partition("+")
        return str(int(left) + int(right))

    agent = Agent(name="calc", tools=[calculator], model=OpenAIChatCompletionsModel(model="policy", openai_client=client))
    result = await Runner.run(agent, item["prompt"], max_turns=4)
    return 1.0 if str(result.final_output).strip().endswith(f"\\boxed{{{item['answer']}}}") else 0.0


async def record_client(client: Any, item: dict[str, Any]) -> float:
    """Writes what it was handed (the client's retries, timeout and proxy address) to the file
    `item["record"]`, then makes one call."""
    import json
    from pathlib import Path

    Path(item["record"]).write_text(json.dumps({"max_retries": client.max_retries, "timeout": client.timeout,
                                                "base_url": str(client.base_url)}))
    await client.chat.completions.create(model="policy", messages=item["messages"])
    return 1.0

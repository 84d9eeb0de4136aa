"""The long-tail workload of `bench/balance.py --train`: an agent whose one call per episode asks
for a completion of a log-normal length and gets exactly that many tokens (`ignore_eos`), so the
training batches have long-tailed lengths whatever the (random, tiny) model writes.

    rollout: {workflow: agent, agent: {entry: bench/_longtail_agent.py:run}}

The n-th episode of an item draws its length from a generator seeded with (item id, n): two runs
over the same items get the same lengths in every group, so their batches are alike step by step.
The reward is a coin from the same generator (GRPO needs reward differences within a group)."""

from __future__ import annotations

import random
from typing import TYPE_CHECKING, Any

from tandem.data.tasks.base import item_messages

if TYPE_CHECKING:
    import openai

MU, SIGMA = 4.5, 1.2  # log-normal of the completion length: median ~90 tokens, 1% above ~1450
MIN_TOKENS, MAX_TOKENS = 8, 1024  # the clip; the run's gen.max_new_tokens is MAX_TOKENS
_EPISODES: dict[str, int] = {}  # item id -> episodes started (agents run on the controller's one event loop)


def completion_length(item_id: str, n: int) -> tuple[int, float]:
    """The length and reward of the `n`-th episode of `item_id`."""
    rng = random.Random(f"{item_id}/{n}")
    length = int(min(MAX_TOKENS, max(MIN_TOKENS, rng.lognormvariate(MU, SIGMA))))
    return length, float(rng.random() < 0.5)


async def run(client: openai.AsyncOpenAI, item: dict[str, Any]) -> float:
    n = _EPISODES.get(str(item["id"]), 0)
    _EPISODES[str(item["id"])] = n + 1
    length, reward = completion_length(str(item["id"]), n)
    await client.chat.completions.create(model="policy", messages=item_messages(item), max_tokens=length,
                                         extra_body={"ignore_eos": True})
    return reward

"""Built-in agents for `rollout.workflow: agent`: user-level code that talks to the policy only
through an `openai.AsyncOpenAI` client, `async def run(client, item) -> float`.

- `tandem.agents.calculator:run`: solves the `calculator` task's problems with its calculator tool.

`agent_for_task` names the agent of a tool-using built-in task: evaluation runs it through the agent
proxy, since one generation cannot use a tool.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from tandem.agents import calculator

Agent = Callable[[Any, dict[str, Any]], Awaitable[float]]
_TASK_AGENTS: dict[str, Agent] = {"calculator": calculator.run}


def agent_for_task(task_name: str) -> Agent | None:
    """The built-in agent that solves the task `task_name` with its tools, or None (single-turn)."""
    return _TASK_AGENTS.get(task_name)

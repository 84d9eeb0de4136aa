"""The `rollout.agent` section: which agent runs an episode and how its calls become trajectories."""

from __future__ import annotations

from dataclasses import dataclass

from tandem.config.fields import config_field as _f
from tandem.user_code import absolute_spec


@dataclass
class AgentConfig:
    entry: str | None = _f(
        None, "The agent: 'package.module:function' or 'path/to/file.py:function', an `async def run(client, item)` "
        "returning a reward (float) or {completion id: reward}; `client` is an openai.AsyncOpenAI on the proxy "
        "(docs/agents.md); a relative file path is relative to the config file that sets it.", resolve=absolute_spec)
    export: str = _f("concat", "Trajectories of an episode: one per chain of calls that extend each other "
                     "(concat) or one per call (individual).", choices=("concat", "individual"))
    discount: float = _f(1.0, "Rewards flow back to earlier calls: r[i] += discount * r[i+1].", min=0.0, max=1.0)
    max_calls: int = _f(32, "Model calls one episode may make; more are refused (HTTP 429).", min=1)
    timeout_s: float = _f(600.0, "Seconds one episode (the agent function) may run; then it is cancelled and "
                          "rejected.", gt=0.0)
    client_max_retries: int = _f(2, "max_retries of the agent's openai client; a retried call replaces the "
                                 "attempt it repeats.", min=0)
    proxy_host: str = _f("127.0.0.1", "Address the agent proxy binds to (agents run in the same process).")

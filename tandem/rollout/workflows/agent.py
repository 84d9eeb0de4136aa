"""The agent workflow: an episode is the user's agent function run `n_samples` times on one item,
each run with its own `openai.AsyncOpenAI` client on the agent proxy (a session of its own), and
the calls it made exported as trajectories of one group (docs/agents.md).

    async def run(client: openai.AsyncOpenAI, item: dict) -> float | dict[str, float]

An agent that raises, returns something else or runs past `rollout.agent.timeout_s` fails the
episode. One proxy per event loop serves every episode there; it starts with the first episode and
stops with `aclose_proxy` (on that loop) or `close`."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from tandem.data.trajectory import Trajectory
from tandem.fleet.generation import GenerationParams
from tandem.rollout.agent.config import AgentConfig
from tandem.rollout.agent.proxy import AgentProxy
from tandem.rollout.agent.session import AgentSession, SessionError
from tandem.rollout.client import InferenceClient
from tandem.rollout.frontier import STREAM_INDEX
from tandem.rollout.workflows.base import RolloutWorkflow
from tandem.user_code import import_user_object

AgentFn = Callable[[Any, dict[str, Any]], Awaitable[float | dict[str, float]]]


class AgentError(RuntimeError):
    """The agent function failed, timed out or returned something that is not a reward."""


class AgentWorkflow(RolloutWorkflow):
    def __init__(self, agent: AgentFn | str, tokenizer: Any, params: GenerationParams, n_samples: int = 1,
                 config: AgentConfig | None = None, max_tokens: int | None = None):
        """`agent`: the function or its import path (imported where the episode runs: rollout
        worker processes receive this workflow pickled). `params`: the run's sampling; every call
        uses it (`max_tokens` of a call may only lower the budget). `max_tokens`: context limit of
        one call (prompt + output)."""
        self.agent_ref = agent
        self.tokenizer, self.params, self.n_samples = tokenizer, params, n_samples
        self.config = config or AgentConfig()
        self.max_tokens = max_tokens
        self._agent: AgentFn | None = None if isinstance(agent, str) else agent
        self._proxies: dict[asyncio.AbstractEventLoop, AgentProxy] = {}

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_proxies"], state["_agent"] = {}, None if isinstance(self.agent_ref, str) else self._agent
        return state

    def agent(self) -> AgentFn:
        if self._agent is None:
            self._agent = load_agent(str(self.agent_ref))
        return self._agent

    async def proxy(self, client: InferenceClient) -> AgentProxy:
        """This loop's proxy over `client` (started on first use)."""
        loop = asyncio.get_running_loop()
        proxy = self._proxies.get(loop)
        if proxy is None:
            proxy = AgentProxy(client, self.tokenizer, self.max_tokens, host=self.config.proxy_host)
            self._proxies[loop] = proxy
            await proxy.start()
        return proxy

    async def arun_episode(self, client: InferenceClient, item: dict[str, Any]) -> list[Trajectory] | None:
        proxy = await self.proxy(client)
        prompt_id = str(item.get("id", uuid.uuid4().hex))
        group_id = f"{prompt_id}:{uuid.uuid4().hex[:8]}"
        try:
            async with asyncio.TaskGroup() as tg:  # one failed run cancels its siblings
                runs = [tg.create_task(self.run_once(proxy, item, prompt_id, group_id)) for _ in range(self.n_samples)]
        except ExceptionGroup as group:  # the first failure, as the executor logs it
            raise group.exceptions[0] from None
        return [t for run in runs for t in run.result()] or None

    async def run_once(self, proxy: AgentProxy, item: dict[str, Any], prompt_id: str, group_id: str) -> list[Trajectory]:
        """One run of the agent in a session of its own; its trajectories (rewards assigned)."""
        session, result = await self._run(proxy, item, prompt_id, self.params)
        try:
            session.assign_rewards(result)
        except SessionError as exc:
            raise AgentError(f"agent {_name(self.agent())}: {exc}") from None
        return session.export(self.config.export, group_id, prompt_id)  # type: ignore[arg-type]

    async def score_once(self, proxy: AgentProxy, item: dict[str, Any], params: GenerationParams) -> tuple[float, int, int]:
        """One run for evaluation (with `params`, e.g. greedy): (the episode's reward: the number
        the agent returned, or the sum of its per-call rewards; output tokens; calls)."""
        session, result = await self._run(proxy, item, str(item.get("id", "")), params)
        if isinstance(result, bool) or not isinstance(result, int | float | dict):
            raise AgentError(f"agent {_name(self.agent())} returned {type(result).__name__}, not a reward")
        value = sum(float(v) for v in result.values()) if isinstance(result, dict) else float(result)
        return value, sum(len(c.output_ids) for c in session.live), len(session.live)

    async def _run(self, proxy: AgentProxy, item: dict[str, Any], prompt_id: str,
                   params: GenerationParams) -> tuple[AgentSession, Any]:
        import openai

        cfg = self.config
        session = proxy.open_session(prompt_id, params, cfg.discount, cfg.max_calls)
        client = openai.AsyncOpenAI(base_url=proxy.base_url, api_key=session.key, max_retries=cfg.client_max_retries,
                                    timeout=cfg.timeout_s)
        agent = self.agent()
        try:
            return session, await asyncio.wait_for(agent(client, agent_item(item)), cfg.timeout_s)
        except TimeoutError:
            raise AgentError(f"agent {_name(agent)} ran past rollout.agent.timeout_s={cfg.timeout_s:g}s") from None
        except Exception as exc:
            raise AgentError(f"agent {_name(agent)} raised {type(exc).__name__}: {exc}") from exc
        finally:
            proxy.close_session(session)
            with contextlib.suppress(Exception):
                await client.close()

    async def aclose_proxy(self) -> None:
        """Stop this loop's proxy (before the loop ends)."""
        proxy = self._proxies.pop(asyncio.get_running_loop(), None)
        if proxy is not None:
            await proxy.aclose()

    def close(self) -> None:
        for loop, proxy in list(self._proxies.items()):
            if loop.is_closed():
                continue
            with contextlib.suppress(RuntimeError):
                asyncio.run_coroutine_threadsafe(proxy.aclose(), loop).result(15.0)
        self._proxies.clear()


def agent_item(item: dict[str, Any]) -> dict[str, Any]:
    """What the agent sees of an item: everything but the rendered prompt ids and stream position."""
    return {k: v for k, v in item.items() if k not in ("input_ids", STREAM_INDEX)}


def load_agent(path: str) -> AgentFn:
    """The agent function at `path` ('module:function' or 'file.py:function'); AgentError when it
    is missing or not an async function."""
    try:
        fn = import_user_object(path)
    except Exception as exc:
        raise AgentError(f"rollout.agent.entry={path!r} cannot be loaded: {type(exc).__name__}: {exc}") from exc
    if not inspect.iscoroutinefunction(fn):
        raise AgentError(f"rollout.agent.entry={path!r} is not an async function; write `async def run(client, "
                         "item)`: the client is an openai.AsyncOpenAI")
    return fn  # type: ignore[return-value]


def _name(fn: Any) -> str:
    return f"{getattr(fn, '__module__', '?')}:{getattr(fn, '__qualname__', repr(fn))}"


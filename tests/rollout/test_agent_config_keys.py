"""The `rollout.agent.*` keys that shape an agent's episode, loaded through the run config and
shown on `AgentWorkflow` episodes against a fake server over real HTTP (through the agent proxy
and the real `openai` client): how many calls an episode may make, the client the agent is handed
(its retries and timeout) and the address the proxy binds. Export, discount and the episode
timeout are shown in test_agent_proxy.py; the entry point in tests/rl/test_workflows.py."""

from __future__ import annotations

import asyncio
import json

import pytest
from transformers import AutoTokenizer

from tandem.models.tiny import init_model
from tandem.rl.config import load_run_config
from tandem.rl.trainer import workflow_for
from tandem.rollout.client import InferenceClient
from tandem.rollout.reward import RewardRunner
from tandem.rollout.workflows.agent import AgentError, AgentWorkflow
from tests.rollout import rewards

pytestmark = pytest.mark.timeout(120)
ITEM = {"id": "q1", "prompt": "2 + 3", "messages": [{"role": "user", "content": "2 + 3"}], "answer": "5",
        "input_ids": [1, 2, 3], "stream_index": 0}


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return AutoTokenizer.from_pretrained(init_model(tmp_path_factory.mktemp("agent-keys") / "tiny", preset="tiny", seed=0))


def workflow(tokenizer, agent: str, *overrides: str) -> AgentWorkflow:
    cfg = load_run_config(None, ["rollout.workflow=agent", f"rollout.agent.entry=tests.rollout.agents:{agent}",
                                 "gen.n_samples=1", "gen.max_new_tokens=4", *overrides])
    runner = RewardRunner(max_workers=1, timeout_s=1.0)  # an agent's reward is its own: never used
    try:
        wf = workflow_for(cfg, tokenizer, rewards.parity_reward, runner)
    finally:
        runner.close()
    assert isinstance(wf, AgentWorkflow)
    return wf


def episode(address: str, wf: AgentWorkflow, item: dict):
    async def main():
        client = InferenceClient([address])
        try:
            return await wf.arun_episode(client, item)
        finally:
            await wf.aclose_proxy()
            await client.aclose()

    return asyncio.run(asyncio.wait_for(main(), 60))


def test_max_calls_refuses_the_calls_beyond_it(make_server, tokenizer):
    """Catches `rollout.agent.max_calls` not reaching the proxy's sessions: the three-turn agent
    fails on its third call with max_calls=2 (HTTP 429, not retried with client_max_retries=0) and
    completes with max_calls=3."""
    server = make_server(vocab_size=len(tokenizer))
    no_retry = "rollout.agent.client_max_retries=0"
    with pytest.raises(AgentError, match="RateLimitError"):
        episode(server.address, workflow(tokenizer, "three_turns", "rollout.agent.max_calls=2", no_retry), ITEM)
    (traj,) = episode(server.address, workflow(tokenizer, "three_turns", "rollout.agent.max_calls=3", no_retry), ITEM)
    assert traj.num_turns == 3


def test_the_agent_gets_the_configured_client_and_proxy(make_server, tokenizer, tmp_path):
    """Catches `rollout.agent.client_max_retries`, `timeout_s` or `proxy_host` not reaching what
    the agent is handed: its openai client's retries and timeout, and the proxy's address (bound
    where the key says)."""
    server = make_server(vocab_size=len(tokenizer))
    seen = {}
    for name, overrides in {"default": [], "set": ["rollout.agent.client_max_retries=5", "rollout.agent.timeout_s=42",
                                                   "rollout.agent.proxy_host=127.0.0.2"]}.items():
        record = tmp_path / f"{name}.json"
        (traj,) = episode(server.address, workflow(tokenizer, "record_client", *overrides), {**ITEM, "record": str(record)})
        assert traj.reward == 1.0
        seen[name] = json.loads(record.read_text())
    assert seen["default"]["max_retries"] == 2 and seen["default"]["timeout"] == 600.0
    assert seen["default"]["base_url"].startswith("http://127.0.0.1:")
    assert seen["set"]["max_retries"] == 5 and seen["set"]["timeout"] == 42.0
    assert seen["set"]["base_url"].startswith("http://127.0.0.2:")

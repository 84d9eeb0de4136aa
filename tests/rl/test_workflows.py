"""`rollout.workflow` picks what `tandem train` runs (`tandem.rl.trainer.workflow_for` over
`tandem.rollout.workflows.build`)."""

from __future__ import annotations

import pickle

import pytest

from tandem.errors import ConfigError
from tandem.rl.config import load_run_config
from tandem.rl.trainer import workflow_for
from tandem.rollout.reward import RewardRunner
from tandem.rollout.workflows import GroupWorkflow, MultiTurnWorkflow, RewardFeedback, RLVRWorkflow
from tandem.rollout.workflows.agent import AgentWorkflow
from tests.rollout import agents, rewards


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture
def runner():
    r = RewardRunner(max_workers=1, timeout_s=1.0)
    yield r
    r.close()


def test_rlvr_is_the_default(tokenizer, runner):
    cfg = load_run_config(None, ["gen.n_samples=3", "rollout.seed_sampling=true", "experiment.seed=7"])
    wf = workflow_for(cfg, tokenizer, rewards.parity_reward, runner)
    assert isinstance(wf, RLVRWorkflow)
    assert (wf.n_samples, wf.seed, wf.reward_fn, wf.reward_runner) == (3, 7, rewards.parity_reward, runner)


def test_multi_turn_is_a_group_of_conversations_fed_back_by_the_reward(tokenizer, runner):
    cfg = load_run_config(None, ["rollout.workflow=multi_turn", "gen.n_samples=5", "gen.max_new_tokens=7",
                                 "rollout.multi_turn.max_turns=3", "rollout.multi_turn.success_reward=0.5",
                                 "rollout.multi_turn.retry_message=Nope"])
    wf = workflow_for(cfg, tokenizer, rewards.parity_reward, runner)
    assert isinstance(wf, GroupWorkflow) and wf.n == 5
    inner = wf.workflow
    assert isinstance(inner, MultiTurnWorkflow) and inner.max_turns == 3 and inner.params.max_new_tokens == 7
    fb = inner.feedback_fn
    assert isinstance(fb, RewardFeedback) and fb.runner is runner and fb.reward_fn is rewards.parity_reward
    assert (fb.success_reward, fb.retry_message) == (0.5, "Nope")
    pickle.loads(pickle.dumps(wf)).workflow.feedback_fn.runner.close()  # rollout.workers > 0 pickle it


def test_agent_runs_the_configured_agent_function(tokenizer, runner, tmp_path):
    cfg = load_run_config(None, ["rollout.workflow=agent", "rollout.agent.entry=tests.rollout.agents:three_turns",
                                 "gen.n_samples=3", "gen.temperature=0.7", "rollout.agent.export=individual"])
    wf = workflow_for(cfg, tokenizer, rewards.parity_reward, runner)
    assert isinstance(wf, AgentWorkflow)
    assert (wf.n_samples, wf.params.temperature, wf.config.export) == (3, 0.7, "individual")
    assert pickle.loads(pickle.dumps(wf)).agent() is agents.three_turns  # rollout.workers > 0 pickle it


def test_agent_entry_is_checked_when_the_config_loads(tmp_path):
    with pytest.raises(ConfigError, match=r"rollout\.workflow=agent needs rollout\.agent\.entry"):
        load_run_config(None, ["rollout.workflow=agent"])
    with pytest.raises(ConfigError, match=r"rollout\.agent\.entry: .* is not an async function"):
        load_run_config(None, ["rollout.workflow=agent", "rollout.agent.entry=tests.rollout.agents:not_async"])
    with pytest.raises(ConfigError, match=r"rollout\.agent\.entry: .*has no 'missing'"):
        load_run_config(None, ["rollout.workflow=agent", "rollout.agent.entry=tests.rollout.agents:missing"])
    (tmp_path / "my_agent.py").write_text("async def run(client, item):\n    return 1.0\n")
    (tmp_path / "run.yaml").write_text("rollout:\n  workflow: agent\n  agent:\n    entry: my_agent.py:run\n")
    cfg = load_run_config(str(tmp_path / "run.yaml"))  # relative to the config file
    assert cfg.rollout.agent.entry == f"{tmp_path / 'my_agent.py'}:run"

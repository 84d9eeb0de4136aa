"""`rollout.workflow` picks what `tandem train` runs (`tandem.rl.workflows.build_workflow`)."""

from __future__ import annotations

import pickle

import pytest

from tandem.errors import ConfigError
from tandem.rl.config import load_run_config
from tandem.rl.workflows import build_workflow
from tandem.rollout.reward import RewardRunner
from tandem.rollout.workflows import GroupWorkflow, MultiTurnWorkflow, RewardFeedback, RLVRWorkflow
from tests.rollout import rewards


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
    wf = build_workflow(cfg, tokenizer, rewards.parity_reward, runner)
    assert isinstance(wf, RLVRWorkflow)
    assert (wf.n_samples, wf.seed, wf.reward_fn, wf.reward_runner) == (3, 7, rewards.parity_reward, runner)


def test_multi_turn_is_a_group_of_conversations_fed_back_by_the_reward(tokenizer, runner):
    cfg = load_run_config(None, ["rollout.workflow=multi_turn", "gen.n_samples=5", "gen.max_new_tokens=7",
                                 "rollout.multi_turn.max_turns=3", "rollout.multi_turn.success_reward=0.5",
                                 "rollout.multi_turn.retry_message=Nope"])
    wf = build_workflow(cfg, tokenizer, rewards.parity_reward, runner)
    assert isinstance(wf, GroupWorkflow) and wf.n == 5
    inner = wf.workflow
    assert isinstance(inner, MultiTurnWorkflow) and inner.max_turns == 3 and inner.params.max_new_tokens == 7
    fb = inner.feedback_fn
    assert isinstance(fb, RewardFeedback) and fb.runner is runner and fb.reward_fn is rewards.parity_reward
    assert (fb.success_reward, fb.retry_message) == (0.5, "Nope")
    pickle.loads(pickle.dumps(wf)).workflow.feedback_fn.runner.close()  # rollout.workers > 0 pickle it


def test_agent_is_not_in_this_build(tokenizer, runner):
    cfg = load_run_config(None, ["rollout.workflow=agent"])
    with pytest.raises(ConfigError, match=r"rollout\.workflow=agent is not available in this build yet"):
        build_workflow(cfg, tokenizer, rewards.parity_reward, runner)

"""The workflow `rollout.workflow` names, built from the rollout config: `rlvr` (`RLVRWorkflow`),
`multi_turn` (`GroupWorkflow` over `MultiTurnWorkflow` with `RewardFeedback`) or `agent`
(`AgentWorkflow`, whose reward is what the agent returns, so `rollout.reward` does not apply).
Every workflow built here pickles (rollout worker processes). See docs/rl.md, "Workflows"."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tandem.errors import ConfigError
from tandem.fleet.generation import GenerationParams
from tandem.rollout.reward import RewardFn, RewardRunner
from tandem.rollout.workflows.agent import AgentWorkflow
from tandem.rollout.workflows.base import RolloutWorkflow
from tandem.rollout.workflows.group import GroupWorkflow
from tandem.rollout.workflows.multi_turn import MultiTurnWorkflow, RewardFeedback
from tandem.rollout.workflows.rlvr import RLVRWorkflow

if TYPE_CHECKING:
    from tandem.rollout.config import RolloutConfig


def build_workflow(config: RolloutConfig, tokenizer: Any, reward_fn: RewardFn, runner: RewardRunner, *,
                   params: GenerationParams, n_samples: int, seed: int) -> RolloutWorkflow:
    """The workflow `config.workflow` names: `params` sampled `n_samples` times per item,
    `reward_fn` scored in `runner`'s processes (the run's reward pool); `seed` seeds the requests
    when `config.seed_sampling`."""
    kind = config.workflow
    if kind == "rlvr":
        return RLVRWorkflow(reward_fn=reward_fn, params=params, n_samples=n_samples, tokenizer=tokenizer,
                            reward_runner=runner, seed=seed if config.seed_sampling else None)
    if kind == "multi_turn":
        mt = config.multi_turn
        feedback = RewardFeedback(reward_fn, runner, success_reward=mt.success_reward,
                                  retry_message=mt.retry_message)
        episode = MultiTurnWorkflow(tokenizer, feedback, params, max_turns=mt.max_turns)
        return GroupWorkflow(episode, n_samples)
    if kind == "agent":
        assert config.agent.entry is not None  # checked with the config
        return AgentWorkflow(config.agent.entry, tokenizer, params, n_samples=n_samples, config=config.agent)
    raise ConfigError(f"rollout.workflow: {kind!r} is not one of 'rlvr', 'multi_turn', 'agent'")

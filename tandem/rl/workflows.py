"""The workflow `tandem train` runs, as `rollout.workflow` chooses it.

- `rlvr`: `RLVRWorkflow`, `gen.n_samples` answers to each prompt scored by the reward, one group.
- `multi_turn`: `gen.n_samples` conversations per prompt (`GroupWorkflow` over `MultiTurnWorkflow`,
  one group): after each answer the reward scores it (`RewardFeedback`, in the reward pool); a
  reward of at least `rollout.multi_turn.success_reward` ends the conversation, a lower one gets
  `rollout.multi_turn.retry_message` as the next user turn, up to `rollout.multi_turn.max_turns`
  answers. A conversation's reward is its last answer's.
- `agent`: `AgentWorkflow`, the user's agent function (`rollout.agent.entry`) run `gen.n_samples`
  times per item, each run with an OpenAI client on the agent proxy (docs/agents.md); the reward
  is what the agent returns, so `rollout.reward` does not apply.

Every workflow built here pickles (rollout worker processes, `rollout.workers > 0`).
"""

from __future__ import annotations

from typing import Any

from tandem.errors import ConfigError
from tandem.fleet.generation import GenerationParams
from tandem.rl.config import TandemConfig
from tandem.rollout.agent.workflow import AgentWorkflow
from tandem.rollout.reward import RewardFn, RewardRunner
from tandem.rollout.workflow import RolloutWorkflow
from tandem.rollout.workflows import GroupWorkflow, MultiTurnWorkflow, RewardFeedback, RLVRWorkflow


def build_workflow(cfg: TandemConfig, tokenizer: Any, reward_fn: RewardFn, runner: RewardRunner) -> RolloutWorkflow:
    """The run's workflow: `reward_fn` scored in `runner`'s processes (the run's reward pool)."""
    params = GenerationParams(max_new_tokens=cfg.gen.max_new_tokens, temperature=cfg.gen.temperature,
                              top_p=cfg.gen.top_p, top_k=cfg.gen.top_k)
    kind = cfg.rollout.workflow
    if kind == "rlvr":
        return RLVRWorkflow(reward_fn=reward_fn, params=params, n_samples=cfg.gen.n_samples, tokenizer=tokenizer,
                            reward_runner=runner, seed=cfg.experiment.seed if cfg.rollout.seed_sampling else None)
    if kind == "multi_turn":
        mt = cfg.rollout.multi_turn
        feedback = RewardFeedback(reward_fn, runner, success_reward=mt.success_reward,
                                  retry_message=mt.retry_message)
        episode = MultiTurnWorkflow(tokenizer, feedback, params, max_turns=mt.max_turns)
        return GroupWorkflow(episode, cfg.gen.n_samples)
    if kind == "agent":
        assert cfg.rollout.agent.entry is not None  # checked with the config
        return AgentWorkflow(cfg.rollout.agent.entry, tokenizer, params, n_samples=cfg.gen.n_samples,
                             config=cfg.rollout.agent)
    raise ConfigError(f"rollout.workflow: {kind!r} is not one of 'rlvr', 'multi_turn', 'agent'")

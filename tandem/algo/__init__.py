"""RL algorithms: reward shaping, advantages and PPO-family losses with the decoupled objective.
Entry points: `recipe`, `shape_rewards`, `add_advantages`, `set_prox_logprobs`, `make_policy_loss`
with `policy_loss_weight`, `summarize_stats`; one step's calls in order: docs/algorithms.md."""

from tandem.lazy import lazy_attributes

# Loaded on first use: `tandem.algo.config` (the config schema) must not pull in torch, which the
# advantage and loss modules need; configs then load in a fraction of a second.
_LAZY = {
    "AdvantageOutput": "tandem.algo.advantages",
    "FilterResult": "tandem.algo.advantages",
    "add_advantages": "tandem.algo.advantages",
    "compute_advantages": "tandem.algo.advantages",
    "dynamic_filter": "tandem.algo.advantages",
    "gae": "tandem.algo.advantages",
    "group_index": "tandem.algo.advantages",
    "normalize": "tandem.algo.advantages",
    "normalize_with": "tandem.algo.advantages",
    "RECIPES": "tandem.algo.config",
    "AdvantageConfig": "tandem.algo.config",
    "AlgoConfig": "tandem.algo.config",
    "OverlongPenaltyConfig": "tandem.algo.config",
    "PPOConfig": "tandem.algo.config",
    "RewardConfig": "tandem.algo.config",
    "recipe": "tandem.algo.config",
    "PolicyLoss": "tandem.algo.losses",
    "ValueLoss": "tandem.algo.losses",
    "loglinear_prox_logprobs": "tandem.algo.losses",
    "make_policy_loss": "tandem.algo.losses",
    "policy_loss_weight": "tandem.algo.losses",
    "reduce_stats": "tandem.algo.losses",
    "set_prox_logprobs": "tandem.algo.losses",
    "summarize_stats": "tandem.algo.losses",
    "to_input_alignment": "tandem.algo.losses",
    "value_loss": "tandem.algo.losses",
    "batch_logprob_mismatch": "tandem.algo.mismatch",
    "logprob_mismatch": "tandem.algo.mismatch",
    "kl_estimate": "tandem.algo.rewards",
    "kl_rewards": "tandem.algo.rewards",
    "overlong_penalty": "tandem.algo.rewards",
    "shape_rewards": "tandem.algo.rewards",
}

__getattr__ = lazy_attributes(__name__, _LAZY)


__all__ = [
    "RECIPES",
    "AdvantageConfig",
    "AdvantageOutput",
    "AlgoConfig",
    "FilterResult",
    "OverlongPenaltyConfig",
    "PPOConfig",
    "PolicyLoss",
    "RewardConfig",
    "ValueLoss",
    "add_advantages",
    "batch_logprob_mismatch",
    "compute_advantages",
    "dynamic_filter",
    "gae",
    "group_index",
    "kl_estimate",
    "kl_rewards",
    "loglinear_prox_logprobs",
    "logprob_mismatch",
    "make_policy_loss",
    "normalize",
    "normalize_with",
    "overlong_penalty",
    "policy_loss_weight",
    "recipe",
    "reduce_stats",
    "set_prox_logprobs",
    "shape_rewards",
    "summarize_stats",
    "to_input_alignment",
    "value_loss",
]

"""RL algorithms: reward shaping, advantages and PPO-family losses with the decoupled objective.

    cfg = recipe("grpo", max_head_offpolicyness=2)
    r = shape_rewards([t.reward for t in trajs], cfg.reward, [t.num_generated for t in trajs])
    add_advantages(batch, cfg.advantage, group_ids=[t.group_id for t in trajs], rewards=r)
    set_prox_logprobs(batch, engine.forward_logprobs(batch, loss_tokens_only=True).logprobs)
    stats = {}
    engine.train_batch(batch, make_policy_loss(cfg.ppo, version=v, stats=stats), policy_loss_weight)
    summarize_stats(stats)

See docs/algorithms.md.
"""

from tandem.algo.advantages import (
    AdvantageOutput,
    FilterResult,
    add_advantages,
    compute_advantages,
    dynamic_filter,
    gae,
    group_index,
    normalize,
    normalize_with,
)
from tandem.algo.config import (
    RECIPES,
    AdvantageConfig,
    AlgoConfig,
    OverlongPenaltyConfig,
    PPOConfig,
    RewardConfig,
    recipe,
)
from tandem.algo.losses import (
    PolicyLoss,
    ValueLoss,
    loglinear_prox_logprobs,
    make_policy_loss,
    policy_loss_weight,
    reduce_stats,
    set_prox_logprobs,
    summarize_stats,
    to_input_alignment,
    value_loss,
)
from tandem.algo.mismatch import batch_logprob_mismatch, logprob_mismatch
from tandem.algo.rewards import kl_estimate, kl_rewards, overlong_penalty, shape_rewards

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

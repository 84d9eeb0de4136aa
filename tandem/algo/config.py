"""Algorithm configuration: reward shaping, advantages, the PPO-family loss, and named recipes.

The sections follow the config conventions of `tandem.config.fields` (field metadata carries help
text, `choices` and bounds; `check(prefix)` validates what metadata cannot), so they are mounted in
the run config (`tandem.rl.config`) as they are. `recipe("grpo")` and friends return a ready
`AlgoConfig`; `docs/algorithms.md` explains every field and formula.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from tandem.config.fields import config_field as _f
from tandem.errors import ConfigError

LEVELS = ("batch", "group", "none")
KL_ESTIMATORS = ("k1", "k2", "k3")
IMP_WEIGHT_MODES = ("mask", "clamp", "off")
IMPORTANCE_LEVELS = ("token", "sequence")
PROX_LOGP_METHODS = ("recompute", "loglinear")
RECIPES = ("grpo", "dr_grpo", "rloo", "dapo", "gspo", "ppo", "distill")


def _check_choice(value: Any, choices: tuple[str, ...], key: str) -> None:
    if value not in choices:
        raise ConfigError(f"{key}: {value!r} is not one of {', '.join(map(repr, choices))}")


@dataclass
class OverlongPenaltyConfig:
    enabled: bool = _f(False, "DAPO soft overlong penalty on responses near max_new_tokens.")
    overlong_tokens: int = _f(
        0, "Length of the penalty zone: responses longer than max_new_tokens - overlong_tokens are penalised.", min=0
    )
    factor: float = _f(1.0, "Penalty at max_new_tokens (it grows linearly over the zone).", min=0.0)


@dataclass
class RewardConfig:
    reward_bias: float = _f(0.0, "Added to every outcome reward before scaling.")
    reward_scaling: float = _f(1.0, "Multiplies (reward + reward_bias).")
    reward_clip: float = _f(20.0, "Shaped rewards are clipped to [-reward_clip, reward_clip].", min=0.0)
    overlong_penalty: OverlongPenaltyConfig = field(default_factory=OverlongPenaltyConfig)
    max_new_tokens: int = _f(0, "Generation length limit the overlong penalty measures against.", min=0)

    def check(self, prefix: str = "") -> None:
        pen = self.overlong_penalty
        if not pen.enabled:
            return
        key = f"{prefix}overlong_penalty"
        if pen.overlong_tokens <= 0:
            raise ConfigError(f"{key}.overlong_tokens must be > 0 when the overlong penalty is enabled")
        if self.max_new_tokens <= pen.overlong_tokens:
            raise ConfigError(
                f"{prefix}max_new_tokens ({self.max_new_tokens}) must exceed {key}.overlong_tokens "
                f"({pen.overlong_tokens}): the penalty starts at max_new_tokens - overlong_tokens; set "
                f"{prefix}max_new_tokens to the rollout's generation limit"
            )


@dataclass
class AdvantageConfig:
    mean_level: str = _f("group", "Baseline subtracted: per-prompt group, whole batch, or none.", choices=LEVELS)
    std_level: str = _f("group", "Std the advantage is divided by: group, batch, or none (1).", choices=LEVELS)
    leave_one_out: bool = _f(False, "Baseline of sample i excludes i: (sum - x_i) / (N - 1) (RLOO).")
    unbiased_std: bool = _f(False, "Std divides by N - 1 instead of N.")
    eps: float = _f(1e-5, "Added to the std before dividing.", min=0.0)
    gamma: float = _f(1.0, "Discount over generated tokens.", min=0.0)
    lam: float = _f(1.0, "GAE lambda.", min=0.0)

    def check(self, prefix: str = "") -> None:
        _check_choice(self.mean_level, LEVELS, f"{prefix}mean_level")
        _check_choice(self.std_level, LEVELS, f"{prefix}std_level")
        if self.leave_one_out and self.mean_level == "none":
            raise ConfigError(f"{prefix}leave_one_out needs a baseline: set {prefix}mean_level to group or batch")
        if self.gamma > 1.0 or self.lam > 1.0:
            raise ConfigError(f"{prefix}gamma and {prefix}lam must be in [0, 1]")


@dataclass
class PPOConfig:
    eps_clip: float = _f(0.2, "PPO clip: ratio pi_theta/pi_prox is clipped to [1 - eps_clip, 1 + eps_clip_higher].", min=0.0)
    eps_clip_higher: float | None = _f(None, "Upper clip (DAPO's clip-higher); None = eps_clip.")
    dual_clip: float | None = _f(None, "Dual-clip constant c > 1 bounding the loss of negative advantages; None = off.")
    behave_imp_weight_cap: float = _f(5.0, "Cap on the behaviour weight w = pi_prox/pi_behave.", min=0.0)
    behave_imp_weight_mode: str = _f(
        "mask",
        "What happens above the cap: mask (no loss), clamp (w = cap), off (no behaviour weight at all).",
        choices=IMP_WEIGHT_MODES,
    )
    behave_imp_weight_level: str = _f(
        "token", "Behaviour weight per token, or per sequence (geometric mean).", choices=IMPORTANCE_LEVELS
    )
    importance_level: str = _f(
        "token", "PPO ratio per token, or per sequence (GSPO: geometric mean).", choices=IMPORTANCE_LEVELS
    )
    prox_logp: str = _f(
        "recompute",
        "Proximal logprobs: recompute (a forward pass, exact) or loglinear (interpolated from versions).",
        choices=PROX_LOGP_METHODS,
    )
    kl_ctl: float = _f(0.0, "Weight of the KL to a frozen reference model (ref.path; 0 = no reference model).",
                       min=0.0)
    kl_estimator: str = _f("k1", "KL estimator: k1 = d, k2 = d^2/2, k3 = exp(-d) - 1 + d with d = logp - logp_ref.",
                           choices=KL_ESTIMATORS)
    kl_in_loss: bool = _f(False, "The KL term goes into the loss (kl_ctl * KL(logp_theta, logp_ref) per token, "
                                 "with gradient) instead of the reward (-kl_ctl * KL(logp_behave, logp_ref) per token, "
                                 "before advantages).")
    use_critic: bool = _f(False, "PPO with a value model (the critic section) and GAE (algo.advantage.gamma, lam).")
    value_eps_clip: float = _f(0.2, "Value clip around the old value estimate (critic only).", min=0.0)
    dynamic_filtering: bool = _f(False, "DAPO: drop groups whose rewards are all equal.")
    max_head_offpolicyness: int = _f(
        0, "Staleness bound of the rollouts (copied from the rollout config, for validation).", min=0
    )

    @property
    def eps_high(self) -> float:
        return self.eps_clip if self.eps_clip_higher is None else self.eps_clip_higher

    def check(self, prefix: str = "") -> None:
        _check_choice(self.behave_imp_weight_mode, IMP_WEIGHT_MODES, f"{prefix}behave_imp_weight_mode")
        _check_choice(self.behave_imp_weight_level, IMPORTANCE_LEVELS, f"{prefix}behave_imp_weight_level")
        _check_choice(self.importance_level, IMPORTANCE_LEVELS, f"{prefix}importance_level")
        _check_choice(self.prox_logp, PROX_LOGP_METHODS, f"{prefix}prox_logp")
        _check_choice(self.kl_estimator, KL_ESTIMATORS, f"{prefix}kl_estimator")
        if not 0.0 <= self.eps_clip < 1.0:
            raise ConfigError(f"{prefix}eps_clip must be in [0, 1), got {self.eps_clip}")
        if self.eps_clip_higher is not None and self.eps_clip_higher < 0:
            raise ConfigError(f"{prefix}eps_clip_higher must be >= 0 (or null to use eps_clip)")
        if self.dual_clip is not None and self.dual_clip <= 1.0:
            raise ConfigError(f"{prefix}dual_clip must be > 1 (or null to turn it off), got {self.dual_clip}")
        if self.behave_imp_weight_mode != "off" and self.behave_imp_weight_cap <= 1.0:
            raise ConfigError(
                f"{prefix}behave_imp_weight_cap must be > 1 (w = 1 on fresh samples), got {self.behave_imp_weight_cap}"
            )
        if self.max_head_offpolicyness > 0 and self.behave_imp_weight_mode == "off":
            raise ConfigError(
                f"{prefix}max_head_offpolicyness={self.max_head_offpolicyness} with "
                f"{prefix}behave_imp_weight_mode='off' is refused: with staleness > 0 the trainer learns from "
                "samples generated by older policies, and without the off-policy weight "
                "w = pi_prox / pi_behave the PPO ratio pi_theta / pi_prox is applied to tokens drawn from a "
                "different policy than pi_prox, so the update is biased (the decoupled-PPO correction is what "
                f"makes staleness safe). Fix: set {prefix}behave_imp_weight_mode to 'mask' (recommended, with "
                f"{prefix}behave_imp_weight_cap=5) or 'clamp', or train on-policy with max_head_offpolicyness=0"
            )


@dataclass
class DistillConfig:
    kl_coef: float = _f(0.0, "On-policy distillation: weight of the per-token reverse KL to the teacher (the teacher "
                             "section), kl_coef * (logp_teacher - logp_behave) added to the reward of every generated "
                             "token, with any recipe; 0: no teacher. algo.name=distill sets it to 1.", min=0.0)


@dataclass
class AlgoConfig:
    name: str = _f("grpo", "Recipe: sets the defaults of the keys it implies (the table in docs/algorithms.md); keys "
                           "set explicitly override them, except the ones that define the recipe (refused).",
                   choices=RECIPES)
    reward: RewardConfig = field(default_factory=RewardConfig)
    advantage: AdvantageConfig = field(default_factory=AdvantageConfig)
    ppo: PPOConfig = field(default_factory=PPOConfig)
    distill: DistillConfig = field(default_factory=DistillConfig)

    def check(self, prefix: str = "") -> None:
        if self.name == "distill" and self.distill.kl_coef == 0:
            raise ConfigError(f"{prefix}distill.kl_coef=0 with {prefix}name='distill' leaves nothing to learn from: "
                              f"the teacher's KL is the signal; set {prefix}distill.kl_coef > 0 (default 1)")
        self.reward.check(f"{prefix}reward.")
        self.advantage.check(f"{prefix}advantage.")
        self.ppo.check(f"{prefix}ppo.")
        _check_choice(self.name, RECIPES, f"{prefix}name")
        for key, value in RECIPE_DEFINES[self.name].items():
            section, field_name = key.split(".")
            actual = getattr(getattr(self, section), field_name)
            if actual != value:
                raise ConfigError(f"{prefix}{key}={actual!r} contradicts {prefix}name={self.name!r}, which means "
                                  f"{prefix}{key}={value!r}: {RECIPE_HINTS[self.name]}")


# ----------------------------------------------------------------------------------- recipes

_CRITIC_FREE = {"ppo.use_critic": False}
# The keys that define each recipe: another value is a different algorithm, so it is refused
# (every other key a recipe sets is a default that explicit keys override).
RECIPE_DEFINES: dict[str, dict[str, Any]] = {
    "grpo": {**_CRITIC_FREE, "ppo.importance_level": "token"},
    "dr_grpo": {**_CRITIC_FREE, "ppo.importance_level": "token", "advantage.std_level": "none"},
    "rloo": {**_CRITIC_FREE, "ppo.importance_level": "token", "advantage.leave_one_out": True},
    "dapo": {**_CRITIC_FREE, "ppo.importance_level": "token"},
    "gspo": {**_CRITIC_FREE, "ppo.importance_level": "sequence"},
    "ppo": {"ppo.use_critic": True, "ppo.importance_level": "token"},
    "distill": {**_CRITIC_FREE, "ppo.importance_level": "token"},
}
RECIPE_HINTS = {
    "grpo": "a critic means algo.name=ppo; sequence-level ratios mean algo.name=gspo",
    "dr_grpo": "Dr. GRPO does not divide by the std (that is algo.name=grpo); a critic means algo.name=ppo",
    "rloo": "RLOO's baseline leaves the sample out (without it, use algo.name=dr_grpo); a critic means algo.name=ppo",
    "dapo": "a critic means algo.name=ppo; sequence-level ratios mean algo.name=gspo",
    "gspo": "GSPO's ratio is per sequence (per token, use algo.name=grpo); a critic means algo.name=ppo",
    "ppo": "PPO here trains a critic (critic-free: algo.name=grpo, dr_grpo, rloo, dapo or gspo)",
    "distill": "distillation learns from the teacher's per-token KL, token by token (a critic means algo.name=ppo "
               "with algo.distill.kl_coef > 0)",
}


def _recipe_parts(name: str) -> tuple[RewardConfig, AdvantageConfig, PPOConfig, DistillConfig]:
    reward, adv, ppo, distill = RewardConfig(), AdvantageConfig(), PPOConfig(), DistillConfig()
    if name == "grpo":
        adv.mean_level, adv.std_level = "group", "group"
    elif name == "dr_grpo":
        adv.mean_level, adv.std_level = "group", "none"
    elif name == "rloo":
        adv.mean_level, adv.std_level, adv.leave_one_out = "group", "none", True
    elif name == "dapo":
        adv.mean_level, adv.std_level = "group", "group"
        ppo.eps_clip, ppo.eps_clip_higher = 0.2, 0.28
        ppo.dynamic_filtering = True
        reward.overlong_penalty.enabled = True
    elif name == "gspo":
        adv.mean_level, adv.std_level = "group", "group"
        ppo.importance_level = "sequence"
        ppo.behave_imp_weight_level = "sequence"
        # Sequence-level ratios sit much closer to 1 than token ratios; the GSPO paper clips at
        # about 3e-4 / 4e-4.
        ppo.eps_clip, ppo.eps_clip_higher = 3e-4, 4e-4
    elif name == "ppo":
        adv.mean_level, adv.std_level = "batch", "batch"
        adv.gamma, adv.lam = 1.0, 0.95
        ppo.use_critic = True
    elif name == "distill":
        # On-policy distillation (Agarwal et al. 2024; Thinking Machines 2025): each generated token's
        # advantage is its own reverse-KL term, logp_teacher - logp_behave, undiscounted by later
        # tokens (gamma 0) and not normalised; the task's outcome reward is left out (scaling 0).
        adv.mean_level, adv.std_level, adv.gamma = "none", "none", 0.0
        reward.reward_scaling = 0.0
        distill.kl_coef = 1.0
    else:
        raise ConfigError(f"unknown algorithm recipe {name!r}; choose one of {', '.join(RECIPES)}")
    return reward, adv, ppo, distill


def recipe(name: str, *, max_new_tokens: int = 0, max_head_offpolicyness: int = 0, **ppo_overrides: Any) -> AlgoConfig:
    """A validated `AlgoConfig` for a named recipe (see `RECIPES`).

    `max_new_tokens` feeds the DAPO overlong penalty (whose zone defaults to a quarter of it);
    `max_head_offpolicyness` is the rollout staleness bound; other keywords override `PPOConfig`
    fields, e.g. `recipe("grpo", behave_imp_weight_mode="clamp")`.
    """
    reward, adv, ppo, distill = _recipe_parts(name)
    if reward.overlong_penalty.enabled and max_new_tokens <= 1:
        raise ConfigError(
            f"recipe {name!r} applies the DAPO overlong penalty and needs max_new_tokens (the rollout's "
            "generation limit), e.g. recipe('dapo', max_new_tokens=512)"
        )
    reward.max_new_tokens = max_new_tokens
    if reward.overlong_penalty.enabled and reward.overlong_penalty.overlong_tokens == 0:
        reward.overlong_penalty.overlong_tokens = max(1, max_new_tokens // 4)
    ppo.max_head_offpolicyness = max_head_offpolicyness
    unknown = set(ppo_overrides) - {f.name for f in dataclasses.fields(PPOConfig)}
    if unknown:
        raise ConfigError(f"unknown PPOConfig field(s) {sorted(unknown)}")
    ppo = dataclasses.replace(ppo, **ppo_overrides)
    cfg = AlgoConfig(name=name, reward=reward, advantage=adv, ppo=ppo, distill=distill)
    cfg.check()
    return cfg

"""Algorithm config: recipes produce the documented settings, unsafe async configs are refused."""

from __future__ import annotations

import re

import pytest

from tandem.algo import RECIPES, AlgoConfig, PPOConfig, recipe
from tandem.config.loader import load_config
from tandem.errors import ConfigError


def test_recipes_settings():
    grpo = recipe("grpo")
    assert (grpo.advantage.mean_level, grpo.advantage.std_level, grpo.advantage.leave_one_out) == ("group", "group", False)
    assert grpo.ppo.eps_high == grpo.ppo.eps_clip == 0.2 and not grpo.ppo.use_critic

    dr = recipe("dr_grpo")
    assert (dr.advantage.mean_level, dr.advantage.std_level) == ("group", "none")

    rloo = recipe("rloo")
    assert (rloo.advantage.mean_level, rloo.advantage.std_level, rloo.advantage.leave_one_out) == ("group", "none", True)

    dapo = recipe("dapo", max_new_tokens=512)
    assert (dapo.ppo.eps_clip, dapo.ppo.eps_high) == (0.2, 0.28)
    assert dapo.ppo.dynamic_filtering and dapo.reward.overlong_penalty.enabled
    assert dapo.reward.max_new_tokens == 512 and dapo.reward.overlong_penalty.overlong_tokens == 128
    assert (dapo.advantage.mean_level, dapo.advantage.std_level) == ("group", "group")

    gspo = recipe("gspo")
    assert gspo.ppo.importance_level == "sequence" and gspo.ppo.behave_imp_weight_level == "sequence"

    ppo = recipe("ppo")
    assert ppo.ppo.use_critic and ppo.advantage.lam == 0.95
    distill = recipe("distill")
    assert distill.distill.kl_coef == 1.0 and distill.reward.reward_scaling == 0.0
    assert (distill.advantage.mean_level, distill.advantage.std_level, distill.advantage.gamma) == ("none", "none", 0.0)
    assert not distill.ppo.use_critic
    assert set(RECIPES) == {"grpo", "dr_grpo", "rloo", "dapo", "gspo", "ppo", "distill"}


def test_recipe_errors():
    with pytest.raises(ConfigError, match="unknown algorithm recipe"):
        recipe("a2c")
    with pytest.raises(ConfigError, match="max_new_tokens"):
        recipe("dapo")  # the overlong penalty needs the generation limit
    with pytest.raises(ConfigError, match="unknown PPOConfig"):
        recipe("grpo", eps=0.1)
    assert recipe("grpo", behave_imp_weight_mode="clamp").ppo.behave_imp_weight_mode == "clamp"


def test_stale_without_correction_is_refused():
    with pytest.raises(ConfigError) as err:
        PPOConfig(max_head_offpolicyness=2, behave_imp_weight_mode="off").check("algo.ppo.")
    msg = str(err.value)
    assert "algo.ppo.max_head_offpolicyness=2" in msg and "biased" in msg
    assert "'mask'" in msg and "'clamp'" in msg and "max_head_offpolicyness=0" in msg
    with pytest.raises(ConfigError, match="refused"):
        recipe("grpo", max_head_offpolicyness=1, behave_imp_weight_mode="off")
    # On-policy without the weight, and stale with it, are both fine.
    recipe("grpo", max_head_offpolicyness=0, behave_imp_weight_mode="off")
    recipe("grpo", max_head_offpolicyness=4, behave_imp_weight_mode="mask")
    # The loss factory validates too.
    from tandem.algo import make_policy_loss

    with pytest.raises(ConfigError, match="refused"):
        make_policy_loss(PPOConfig(max_head_offpolicyness=1, behave_imp_weight_mode="off"))


def test_other_checks():
    with pytest.raises(ConfigError, match="dual_clip"):
        PPOConfig(dual_clip=0.5).check()
    with pytest.raises(ConfigError, match="behave_imp_weight_cap"):
        PPOConfig(behave_imp_weight_cap=1.0).check()
    with pytest.raises(ConfigError, match=r"importance_level='sequence' contradicts algo.name='ppo'"):
        AlgoConfig(name="ppo", ppo=PPOConfig(importance_level="sequence", use_critic=True)).check("algo.")


def test_loads_through_the_config_loader(tmp_path):
    path = tmp_path / "algo.yaml"
    path.write_text("ppo:\n  eps_clip_higher: 0.28\n  dual_clip: 3.0\nadvantage:\n  std_level: none\n")
    cfg = load_config(path, ["ppo.max_head_offpolicyness=2", "reward.overlong_penalty.factor=0.5"], schema=AlgoConfig)
    assert cfg.ppo.eps_high == 0.28 and cfg.ppo.dual_clip == 3.0 and cfg.advantage.std_level == "none"
    assert cfg.reward.overlong_penalty.factor == 0.5 and cfg.ppo.max_head_offpolicyness == 2
    with pytest.raises(ConfigError, match=re.escape("ppo.max_head_offpolicyness=2 with ppo.behave_imp_weight_mode='off'")):
        load_config(None, ["ppo.max_head_offpolicyness=2", "ppo.behave_imp_weight_mode=off"], schema=AlgoConfig)
    with pytest.raises(ConfigError, match=r"advantage\.mean_level"):
        load_config(None, ["advantage.mean_level=token"], schema=AlgoConfig)

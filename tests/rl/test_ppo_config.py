"""The `critic` and `ref` sections reach the engines they configure: `tandem train` builds the
critic's engine from `critic_engine_config(cfg)` and the reference's from
`reference_engine_config(cfg)` (tandem.rl.models); what an engine does with its path and optimizer
is shown by the engine tests."""

from __future__ import annotations

import dataclasses

import pytest

from tandem.errors import ConfigError
from tandem.rl.config import load_run_config
from tandem.rl.models import critic_engine_config, reference_engine_config

PPO = ["algo.name=ppo", "algo.ppo.kl_ctl=0.05"]
OPTIMIZER_CHANGES = {"lr": "0.003", "weight_decay": "0.1", "beta1": "0.8", "beta2": "0.99", "eps": "1e-6",
                     "gradient_clipping": "0.5", "lr_scheduler": "cosine", "warmup_steps_proportion": "0.1",
                     "min_lr_ratio": "0.2"}


def _engines(model_dir, *overrides: str):
    cfg = load_run_config(None, [f"actor.path={model_dir}", "actor.backend=archon:d2t2", *PPO, *overrides])
    return critic_engine_config(cfg), reference_engine_config(cfg)


@pytest.mark.parametrize("key", [
    "critic.path", "ref.path", "critic.optimizer.lr", "critic.optimizer.weight_decay", "critic.optimizer.beta1",
    "critic.optimizer.beta2", "critic.optimizer.eps", "critic.optimizer.gradient_clipping",
    "critic.optimizer.lr_scheduler", "critic.optimizer.warmup_steps_proportion", "critic.optimizer.min_lr_ratio"])
def test_critic_and_reference_keys_reach_their_engines(model_dir, tmp_path, key):
    """Catches a critic or reference key the loader accepts but the engines never get."""
    other = tmp_path / "other"
    other.mkdir()
    for f in model_dir.iterdir():  # another model directory: the same files under another path
        (other / f.name).symlink_to(f)
    assert key.endswith(".path") or key.rsplit(".", 1)[1] in OPTIMIZER_CHANGES
    value = str(other) if key.endswith(".path") else OPTIMIZER_CHANGES[key.rsplit(".", 1)[1]]
    before, after = _engines(model_dir), _engines(model_dir, f"{key}={value}")
    assert before != after
    critic, reference = after
    if key == "critic.path":
        assert critic.path == str(other) and reference.path == str(model_dir)
    elif key == "ref.path":
        assert reference.path == str(other) and critic.path == str(model_dir)
    else:
        field = key.rsplit(".", 1)[1]
        assert str(getattr(critic.optimizer, field)) in (value, str(float(value)) if field != "lr_scheduler" else value)
        assert reference.optimizer == before[1].optimizer  # the reference is never trained
    # The critic is data parallel whatever the actor's layout; the reference takes the actor's.
    assert (critic.tp, critic.pp, critic.cp) == (1, 1, 1) and reference.tp == 2


def test_critic_and_reference_paths_are_checked(tmp_path):
    """A critic or reference path that is not a model directory is refused at load, naming the key."""
    for key in ("critic.path", "ref.path"):
        with pytest.raises(ConfigError, match=f"{key}: .* does not exist"):
            load_run_config(None, [*PPO, f"{key}={tmp_path / 'nope'}"])


def test_engine_configs_keep_the_actors_other_options(model_dir):
    critic, reference = _engines(model_dir, "actor.dtype=bfloat16", "actor.mb.max_tokens_per_mb=512")
    for engine in (critic, reference):
        assert engine.dtype == "bfloat16" and engine.mb.max_tokens_per_mb == 512
        assert dataclasses.asdict(engine)["router_replay"] == "off"

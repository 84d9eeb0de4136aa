"""The run config mounts each component's config as it is: `actor` is the training engine's
config, keys one section takes from another are derived in one place and refused when set, and
keys that moved into a nested section are found by the loader's suggestions."""

from __future__ import annotations

import pytest

from tandem.config.loader import to_yaml
from tandem.errors import ConfigError
from tandem.parallel.config import ParallelizeConfig
from tandem.rl.config import SFTRunConfig, TandemConfig, load_run_config
from tandem.train.config import MicroBatchConfig, TrainEngineConfig


def test_actor_is_the_engine_config_with_derived_values():
    cfg = load_run_config(None, ["experiment.device=cuda", "experiment.seed=7", "train.total_steps=30",
                                 "train.n_minibatches=2", "sft.steps=5",
                                 "actor.parallelize.activation_checkpoint=selective", "actor.mb.n_mbs=2"])
    assert isinstance(cfg.actor, TrainEngineConfig) and isinstance(cfg.actor.parallelize, ParallelizeConfig)
    assert (cfg.actor.device, cfg.actor.seed, cfg.actor.total_train_steps) == ("cuda", 7, 60)
    assert cfg.actor.parallelize.activation_checkpoint == "selective"
    assert cfg.actor.mb == MicroBatchConfig(max_tokens_per_mb=2048, n_mbs=2)


def test_sft_schedule_spans_sft_steps():
    cfg = load_run_config(None, ["train.total_steps=30", "sft.steps=5"], command="sft")
    assert isinstance(cfg, SFTRunConfig) and cfg.actor.total_train_steps == 5
    with pytest.raises(ValueError, match="command"):
        load_run_config(None, [], command="eval")


@pytest.mark.parametrize(
    ("override", "instead"),
    [
        ("actor.device=cuda", "experiment.device"),
        ("actor.seed=3", "experiment.seed"),
        ("actor.total_train_steps=9", "train.total_steps"),
        ("algo.ppo.max_head_offpolicyness=2", "rollout.max_head_offpolicyness"),
        ("algo.reward.max_new_tokens=64", "gen.max_new_tokens"),
    ],
)
def test_a_derived_key_is_refused_naming_the_key_to_set(override, instead):
    key = override.split("=")[0]
    with pytest.raises(ConfigError, match=rf"{key} is derived, not set: set {instead}"):
        load_run_config(None, [override])


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ("actor.activation_checkpoint=full", "actor.parallelize.activation_checkpoint"),
        ("actor.ac_every=2", "actor.parallelize.ac_every"),
        ("actor.compile=true", "actor.parallelize.compile"),
        ("actor.max_tokens_per_mb=512", "actor.mb.max_tokens_per_mb"),
    ],
)
def test_keys_that_moved_are_suggested(old, new):
    with pytest.raises(ConfigError, match=rf"did you mean '{new}'"):
        load_run_config(None, [old])


def test_derived_keys_are_neither_suggested_nor_written(tmp_path):
    with pytest.raises(ConfigError) as info:
        load_run_config(None, ["seed=3"])
    assert "'experiment.seed'" in str(info.value) and "actor.seed" not in str(info.value)
    cfg = load_run_config(None, ["experiment.seed=3"])
    text = to_yaml(cfg)
    assert "total_train_steps" not in text and "max_head_offpolicyness: 1" in text  # the rollout's
    (tmp_path / "c.yaml").write_text(text)
    assert load_run_config(tmp_path / "c.yaml") == cfg


def test_dp_replicate_must_divide_the_trainer_ranks():
    load_run_config(None, ["actor.backend=archon:d4", "actor.dp_replicate=2"])
    with pytest.raises(ConfigError, match=r"actor.dp_replicate=3 must divide the data-parallel size 4"):
        load_run_config(None, ["actor.backend=archon:d4", "actor.dp_replicate=3"])


def test_every_derived_key_exists():
    cfg = TandemConfig()
    for key in TandemConfig.DERIVED:
        value = cfg
        for part in key.split("."):
            value = getattr(value, part)

"""`rollout.reward` and `rollout.workflow` as the loader reads them: a relative reward file is found
from the config file that names it (the working directory for overrides), the key that it replaced
(`task.reward_fn`) is named when met, and each mistake in the reward is refused at load time."""

from __future__ import annotations

from pathlib import Path

import pytest

from tandem.cli import main
from tandem.config.loader import to_yaml
from tandem.errors import ConfigError
from tandem.rl.config import load_run_config

REWARD = "def score(prompt_text, completion_text, prompt_ids, completion_ids, **fields):\n    return 0.25\n"


@pytest.fixture
def layout(tmp_path: Path) -> Path:
    """tmp/configs/run.yaml naming rewards/r.py (next to it), and tmp/cwd/r.py (the working directory's)."""
    (tmp_path / "configs" / "rewards").mkdir(parents=True)
    (tmp_path / "configs" / "rewards" / "r.py").write_text(REWARD)
    (tmp_path / "configs" / "run.yaml").write_text("rollout:\n  reward: rewards/r.py:score\n")
    (tmp_path / "cwd").mkdir()
    (tmp_path / "cwd" / "r.py").write_text(REWARD)
    return tmp_path


def test_a_relative_reward_file_is_found_from_the_config_file(layout, monkeypatch):
    monkeypatch.chdir(layout / "cwd")
    cfg = load_run_config(layout / "configs" / "run.yaml")
    assert cfg.rollout.reward == f"{layout}/configs/rewards/r.py:score"
    # On the command line it is relative to the working directory, config file or not.
    for path in (None, layout / "configs" / "run.yaml"):
        assert load_run_config(path, ["rollout.reward=r.py:score"]).rollout.reward == f"{layout}/cwd/r.py:score"
    # The recorded config holds the absolute path: it loads again from anywhere.
    (layout / "cwd" / "recorded.yaml").write_text(to_yaml(cfg))
    monkeypatch.chdir(layout)
    assert load_run_config(layout / "cwd" / "recorded.yaml").rollout.reward == cfg.rollout.reward
    # Module specs are left as they are.
    assert load_run_config(None, ["rollout.reward=tests.rollout.rewards:parity_reward"]).rollout.reward == (
        "tests.rollout.rewards:parity_reward")


def test_a_missing_relative_file_says_where_it_was_looked_for(layout, monkeypatch):
    monkeypatch.chdir(layout)
    (layout / "configs" / "bad.yaml").write_text("rollout:\n  reward: r.py:score\n")
    with pytest.raises(ConfigError) as info:
        load_run_config(layout / "configs" / "bad.yaml")
    assert f"rollout.reward: the file '{layout}/configs/r.py' does not exist" in str(info.value)
    assert "the directory of the config file that sets it" in str(info.value)


@pytest.mark.parametrize("source", ["file", "override"])
def test_task_reward_fn_says_to_use_rollout_reward(tmp_path, source):
    if source == "file":
        (tmp_path / "c.yaml").write_text("task:\n  reward_fn: tests.rollout.rewards:parity_reward\n")
        args: tuple = (tmp_path / "c.yaml", [])
    else:
        args = (None, ["task.reward_fn=tests.rollout.rewards:parity_reward"])
    with pytest.raises(ConfigError) as info:
        load_run_config(*args)
    assert str(info.value).startswith("task.reward_fn is no longer a config key: use rollout.reward (the same "
                                      "'package.module:function', or 'path/to/file.py:function') instead")


@pytest.mark.parametrize(
    ("body", "fragment"),
    [
        (None, "does not exist"),
        ("def other(*a, **k):\n    return 1.0\n", "has no 'score' (it defines: other)"),
        ("score = 0.5\n", "is a float, not a function"),
        ("def score(completion_text):\n    return 1.0\n", "score(completion_text) cannot take the arguments"),
        ("def score(prompt_text, completion_text, prompt_ids, completion_ids):\n    return 1.0\n",
         "got an unexpected keyword argument 'answer'"),
        ("import no_such_module\n", "ModuleNotFoundError"),
    ],
)
def test_reward_mistakes_exit_2_naming_rollout_reward(tmp_path, capsys, body, fragment):
    if body is not None:
        (tmp_path / "r.py").write_text(body)
    assert main(["show-config", f"rollout.reward={tmp_path / 'r.py'}:score"]) == 2
    err = capsys.readouterr().err
    assert "rollout.reward: " in err and fragment in err


def test_rewards_may_declare_item_fields(tmp_path):
    (tmp_path / "r.py").write_text("def score(prompt_text, completion_text, prompt_ids, completion_ids, answer, "
                                   "expression, **rest):\n    return float(completion_text == answer)\n")
    load_run_config(None, [f"rollout.reward={tmp_path / 'r.py'}:score"])


def test_workflow_choices():
    assert load_run_config(None).rollout.workflow == "rlvr"
    cfg = load_run_config(None, ["rollout.workflow=multi_turn", "rollout.multi_turn.max_turns=3"])
    assert (cfg.rollout.workflow, cfg.rollout.multi_turn.max_turns) == ("multi_turn", 3)
    assert cfg.rollout.multi_turn.success_reward == 1.0
    with pytest.raises(ConfigError, match=r"rollout.workflow: 'chat' is not one of 'rlvr', 'multi_turn', 'agent'"):
        load_run_config(None, ["rollout.workflow=chat"])
    with pytest.raises(ConfigError, match=r"rollout.multi_turn.max_turns: 0 is below the minimum 1"):
        load_run_config(None, ["rollout.workflow=multi_turn", "rollout.multi_turn.max_turns=0"])
    with pytest.raises(ConfigError, match=r"rollout.seed_sampling=true seeds the samples of the rlvr workflow"):
        load_run_config(None, ["rollout.workflow=multi_turn", "rollout.seed_sampling=true"])

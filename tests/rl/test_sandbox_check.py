"""`tandem train` and `tandem sft` whose reward runs code (the code task's, or a rollout.reward with
a `sandbox` parameter) stop before anything starts where the sandbox cannot run, exit 2 and say
why; a reward that runs no code starts whatever the sandbox."""

from __future__ import annotations

import pytest

from tandem.cli import main
from tests.rl.common import run_dir, write_config

MISSING = {"sandbox": {"bwrap": "/nonexistent/bwrap"}}
REWARD = ("def score(prompt_text, completion_text, prompt_ids, completion_ids, *, sandbox, **fields):\n"
          "    return sandbox.run(completion_text, ['assert True']).fraction\n")


class Started(Exception):
    pass


@pytest.mark.parametrize("command", ["train", "sft"])
@pytest.mark.parametrize("who", ["task", "reward", "neither"])
def test_a_reward_that_needs_the_sandbox_stops_the_run_where_it_cannot_run(tmp_path, model_dir, monkeypatch,
                                                                             capsys, command, who):
    (tmp_path / "my_reward.py").write_text(REWARD)
    sections = {"rollout": {**MISSING, **({"reward": "my_reward.py:score"} if who == "reward" else {})}}
    if who == "task":
        sections["task"] = {"name": "code", "options": {}}
    cfg = write_config(tmp_path, model_dir, **sections)
    monkeypatch.chdir(tmp_path)

    def started(*args, **kwargs):
        raise Started

    monkeypatch.setattr("tandem.rl.trial.plan_trial", started)
    monkeypatch.setattr("tandem.rl.sft.run_dir_of", started)
    if who == "neither":
        with pytest.raises(Started):
            main([command, str(cfg)])
        return
    assert main([command, str(cfg)]) == 2
    err = capsys.readouterr().err
    which = "the code task's reward" if who == "task" else f"rollout.reward '{tmp_path}/my_reward.py:score'"
    assert (f"tandem {command}: error: {which} runs code in the sandbox, which cannot run here: rollout.sandbox.bwrap: "
            "bubblewrap '/nonexistent/bwrap' was not found") in err, err
    assert not run_dir(tmp_path).exists()

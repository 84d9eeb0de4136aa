"""`tandem.user_code`: what a config's 'package.module:function' or 'path/to/file.py:function'
names, the picklable `UserFunction` that reward worker processes import by itself, and the
config-time check of a user's function."""

from __future__ import annotations

import asyncio
import pickle
from pathlib import Path

import pytest

from tandem.errors import ConfigError
from tandem.launch.rpc import WorkerGroup
from tandem.rollout.reward import RewardRunner
from tandem.train.losses import sft_loss
from tandem.user_code import (
    UserFunction,
    absolute_spec,
    check_user_function,
    import_user_object,
    is_file_spec,
)

USER_FILE = """
import time

CALLS = []

def score(prompt_text, completion_text, prompt_ids, completion_ids, **fields):
    CALLS.append(completion_text)
    return 0.25 + len(completion_ids)

class Grader:
    def grade(self, *args, **fields):
        return 1.0

LIMIT = 3

def one_arg(text):
    return 1.0
"""


@pytest.fixture
def user_file(tmp_path: Path) -> Path:
    path = tmp_path / "my_reward.py"
    path.write_text(USER_FILE)
    return path


def test_import_user_object():
    assert import_user_object("tandem.train:sft_loss") is sft_loss
    assert import_user_object("tandem.train.losses:sft_loss") is sft_loss
    assert import_user_object("tandem.launch.rpc:WorkerGroup.call") is WorkerGroup.call
    for bad in ("tandem.train.sft_loss", ":sft_loss", "tandem.train:"):
        with pytest.raises(ValueError, match=r"package\.module:function"):
            import_user_object(bad)
    with pytest.raises(ModuleNotFoundError):
        import_user_object("tandem.no_such_module:f")
    with pytest.raises(AttributeError):
        import_user_object("tandem.train.losses:no_such_function")


def test_import_from_a_file(user_file, tmp_path, monkeypatch):
    fn = import_user_object(f"{user_file}:score")
    assert fn("p", "c", [1], [2, 3]) == 2.25
    assert import_user_object(f"{user_file}:score") is fn  # the file is imported once per process
    assert import_user_object(f"{user_file}:Grader.grade")(None) == 1.0
    monkeypatch.chdir(tmp_path)
    assert import_user_object("my_reward.py:score") is fn  # relative: from the working directory
    with pytest.raises(FileNotFoundError):
        import_user_object(f"{tmp_path / 'nope.py'}:score")
    with pytest.raises(AttributeError):
        import_user_object(f"{user_file}:nope")


def test_file_specs_and_relative_paths(tmp_path):
    assert is_file_spec("rewards/score.py:f") and is_file_spec("score.py:f") and is_file_spec("/abs/dir/x:f")
    assert not is_file_spec("pkg.mod:f") and not is_file_spec("pkg.mod:Class.f")
    assert absolute_spec("rewards/score.py:f", tmp_path) == f"{tmp_path}/rewards/score.py:f"
    assert absolute_spec("/abs/score.py:f", tmp_path) == "/abs/score.py:f"
    assert absolute_spec("pkg.mod:f", tmp_path) == "pkg.mod:f"
    assert absolute_spec(None, tmp_path) is None


def test_user_function_pickles_as_its_spec(user_file, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    fn = UserFunction("my_reward.py:score")
    assert fn.spec == f"{user_file}:score" and fn.__name__ == "my_reward.py:score"  # absolute from the start
    copy = pickle.loads(pickle.dumps(fn))
    assert copy == fn and copy.__name__ == fn.__name__
    assert copy("p", "c", [], [1]) == 1.25
    assert UserFunction("tandem.train:sft_loss").__name__ == "tandem.train:sft_loss"
    with pytest.raises(TypeError, match="not a function"):
        UserFunction(f"{user_file}:LIMIT")()


def test_a_function_from_a_file_runs_in_the_reward_pool(user_file):
    """The pool's workers are forkserver processes: a function from a file is not importable there
    by module name; its `UserFunction` imports it in each worker."""
    runner = RewardRunner(max_workers=2, timeout_s=10.0)
    try:
        async def score_all():
            return await asyncio.gather(*(runner.ascore(UserFunction(f"{user_file}:score"), "p", "c", [1], [0] * i,
                                                        answer="1") for i in range(4)))

        results = asyncio.run(score_all())
        assert [r.value for r in results] == [0.25, 1.25, 2.25, 3.25]
    finally:
        runner.close()


def test_check_user_function_names_the_key_and_the_fix(user_file, tmp_path):
    args, kwargs = ("", "", [], []), {"answer": ""}
    sig = "(prompt_text, completion_text, prompt_ids, completion_ids, **item_fields) -> float"

    def refused(spec: str) -> str:
        with pytest.raises(ConfigError) as info:
            check_user_function(spec, "rollout.reward", args=args, kwargs=kwargs, signature=sig)
        assert str(info.value).startswith("rollout.reward: ")
        return str(info.value)

    assert check_user_function(f"{user_file}:score", "k", args=args, kwargs=kwargs).__name__ == "score"
    assert "must look like 'package.module:function' or 'path/to/file.py:function'" in refused("score")
    assert f"the file '{tmp_path / 'nope.py'}' does not exist" in refused(f"{tmp_path / 'nope.py'}:score")
    assert "is a directory" in refused(f"{tmp_path}/:score")
    missing = refused(f"{user_file}:scor")
    assert "has no 'scor' (it defines: Grader, one_arg, score)" in missing
    assert "is an int, not a function" in refused(f"{user_file}:LIMIT")
    wrong = refused(f"{user_file}:one_arg")
    assert "one_arg(text) cannot take the arguments it will be called with (too many positional arguments)" in wrong
    assert f"define it as def one_arg{sig}" in wrong
    broken = tmp_path / "broken.py"
    broken.write_text("def score(:\n")
    assert f"importing '{broken}' failed: SyntaxError" in refused(f"{broken}:score")
    raising = tmp_path / "raising.py"
    raising.write_text("raise RuntimeError('no GPU here')\n")
    assert "failed: RuntimeError: no GPU here" in refused(f"{raising}:score")
    assert "cannot import the module 'no_such_pkg.rewards': ModuleNotFoundError" in refused("no_such_pkg.rewards:f")

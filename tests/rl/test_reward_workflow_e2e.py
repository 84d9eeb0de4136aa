"""`rollout.reward` from a file and `rollout.workflow` in real `tandem train` runs (tiny model,
one server, one trainer rank, 2 steps): the user's function scores training and evaluation in the
reward pool; one that raises or hangs ends the run through the error storm with its error (or is
rejected item by item, and the run completes); a reward that cannot be used stops the run at load
time (exit 2); the multi_turn workflow asks again after a wrong answer."""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from pathlib import Path

import pytest

from tandem.data.tasks import get_task
from tandem.rollout.dump import read_dump
from tests.launch.procs import CHILD_ENV
from tests.rl.common import TANDEM, rl_rows, run_dir, write_config

pytestmark = pytest.mark.slow

REWARDS = '''
import os
import time
from pathlib import Path


def length_score(prompt_text, completion_text, prompt_ids, completion_ids, **fields):
    with Path(__file__).with_name("reward-pids.txt").open("a") as f:  # which reward worker scored it
        f.write(f"{os.getpid()}\\n")
    time.sleep(0.2)  # calls overlap, so the pool starts every worker it may
    return 0.25 + len(completion_ids) / 1000


def explode(prompt_text, completion_text, prompt_ids, completion_ids, **fields):
    raise RuntimeError("grader exploded")


def odd_only(prompt_text, completion_text, prompt_ids, completion_ids, answer, **fields):
    if int(answer) % 2 == 0:
        raise RuntimeError(f"cannot grade the even answer {answer}")
    return 1.0


def sleep_forever(*args, **fields):
    time.sleep(3600)


def spin_on_even(prompt_text, completion_text, prompt_ids, completion_ids, answer, **fields):
    if int(answer) % 2 == 0:
        while True:
            pass
    return 0.5


def parity(prompt_text, completion_text, prompt_ids, completion_ids, **fields):
    return float(bool(completion_ids) and completion_ids[-1] % 2 == 0)


NOT_A_FUNCTION = 0.5


def one_argument(completion_text):
    return 1.0
'''


def config(tmp_path: Path, model: Path, reward: str, **sections: dict) -> Path:
    """A small run whose config names `my_reward.py:<reward>` relative to the config file's directory."""
    (tmp_path / "my_reward.py").write_text(REWARDS)
    rollout = {"backend": "tandem:d1", "reward": f"my_reward.py:{reward}", **sections.pop("rollout", {})}
    return write_config(tmp_path, model, actor={"backend": "archon:d1"}, rollout=rollout, **sections)


def train(tmp_path: Path, cfg: Path, timeout: float = 240) -> tuple[subprocess.CompletedProcess, float]:
    """`tandem train cfg` from another working directory (the reward file is found from the config's)."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(exist_ok=True)
    began = time.monotonic()
    proc = subprocess.run([TANDEM, "train", str(cfg)], capture_output=True, text=True, timeout=timeout,
                          cwd=elsewhere, env={**os.environ, **CHILD_ENV})
    took = time.monotonic() - began
    print(f"tandem train: exit {proc.returncode} after {took:.1f}s")
    return proc, took


def timed_out(name: str) -> str:
    """The error of a call stopped at task.reward_timeout_s=1: by the worker's own timer, or (when
    the pool's fresh worker spent part of the second starting, as on a loaded machine) by the
    hard deadline a second later, which kills the worker."""
    return (rf"my_reward\.py:{name}: (reward 'my_reward\.py:{name}' ran past 1s|timed out after 1s) "
            rf"\(the timeout, task\.reward_timeout_s\)")


def eval_rows(tmp_path: Path) -> list[dict]:
    rows = map(json.loads, (run_dir(tmp_path) / "metrics.jsonl").read_text().splitlines())
    return [r for r in rows if "eval/accuracy" in r]


def test_a_reward_from_a_file_scores_training_and_evaluation(tmp_path, model_dir):
    """The reward from the file scores training and evaluation, in task.reward_workers worker
    processes (3 here; the default is 2)."""
    proc, _ = train(tmp_path, config(tmp_path, model_dir, "length_score", task={"reward_workers": 3}))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert len(set((tmp_path / "reward-pids.txt").read_text().split())) == 3
    rows = rl_rows(tmp_path)
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:  # 0.25 + tokens / 1000: no task reward gives that
        assert r["reward/mean"] == pytest.approx(0.25 + r["gen/response_len_mean"] / 1000, abs=1e-6)
    evals = eval_rows(tmp_path)
    assert [r["step"] for r in evals] == [0, 2]
    for r in evals:
        assert r["eval/failed"] == 0
        assert r["eval/accuracy"] == pytest.approx(0.25 + r["eval/response_len"] / 1000, abs=1e-6)
    recorded = (run_dir(tmp_path) / "config.yaml").read_text()
    assert f"reward: {tmp_path}/my_reward.py:length_score" in recorded  # absolute: the run can be rerun anywhere


def test_a_raising_reward_ends_the_run_with_its_error(tmp_path, model_dir):
    cfg = config(tmp_path, model_dir, "explode", rollout={"max_consecutive_failures": 4})
    proc, took = train(tmp_path, cfg)
    err = proc.stderr
    assert proc.returncode == 2, err[-3000:]
    assert ("4 episodes in a row failed (rollout.max_consecutive_failures); the first error: RewardError: 2/2 "
            "rewards of the group failed; the first: my_reward.py:explode: RuntimeError: grader exploded") in err
    assert "eval: 8 of 8 items failed and count as wrong" in err
    assert len(err) < 20_000 and took < 200  # bounded (a loaded CI machine takes ~80 s)


def test_a_reward_that_raises_on_some_items_rejects_those_episodes(tmp_path, model_dir):
    """Even answers make `odd_only` raise: their episodes are failed and rejected, so the items the
    steps trained (`data/prompt_ids`, stream positions) all have odd answers; eval items with even
    answers count as wrong; the run completes."""
    proc, _ = train(tmp_path, config(tmp_path, model_dir, "odd_only"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "my_reward.py:odd_only: RuntimeError: cannot grade the even answer" in proc.stderr
    items = get_task("arithmetic", difficulty="add1", instruction=False).generate(64, seed=1, split="train")
    rows = rl_rows(tmp_path)
    trained = [i for r in rows for i in r["data/prompt_ids"]]
    assert len(trained) == 8 and all(int(items[i % 64]["answer"]) % 2 == 1 for i in trained)
    assert rows[-1]["rollout/failed"] > 0 and rows[-1]["reward/mean"] == 1.0
    evals = eval_rows(tmp_path)
    assert all(0 < r["eval/failed"] < r["eval/n"] for r in evals)
    assert all(r["eval/accuracy"] == (r["eval/n"] - r["eval/failed"]) / r["eval/n"] for r in evals)


def test_a_hanging_reward_times_out_and_ends_the_run(tmp_path, model_dir):
    """`time.sleep(3600)` on every call: each call fails at task.reward_timeout_s, evaluation counts
    every item wrong, training ends through the error storm, in bounded time."""
    cfg = config(tmp_path, model_dir, "sleep_forever", task={"reward_timeout_s": 1.0},
                 rollout={"max_consecutive_failures": 4})
    proc, took = train(tmp_path, cfg)
    err = proc.stderr
    assert proc.returncode == 2, err[-3000:]
    assert "4 episodes in a row failed" in err
    assert re.search(timed_out("sleep_forever"), err)
    assert "eval: 8 of 8 items failed and count as wrong" in err
    assert took < 200


def test_a_reward_that_spins_on_some_items_times_out_there_and_the_run_completes(tmp_path, model_dir):
    """`while True: pass` on even answers: those calls are stopped at task.reward_timeout_s and their
    episodes rejected; the other items train and the run completes."""
    cfg = config(tmp_path, model_dir, "spin_on_even", task={"reward_timeout_s": 1.0})
    proc, took = train(tmp_path, cfg)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert re.search(timed_out("spin_on_even"), proc.stderr)
    rows = rl_rows(tmp_path)
    assert [r["step"] for r in rows] == [1, 2]
    assert rows[-1]["rollout/failed"] > 0 and all(r["reward/mean"] == 0.5 for r in rows)
    assert took < 200


@pytest.mark.parametrize(
    ("reward", "fragment"),
    [
        ("missing.py:score", "rollout.reward: the file '{dir}/missing.py' does not exist"),
        ("my_reward.py:no_such_function", "rollout.reward: 'my_reward.py' has no 'no_such_function'"),
        ("my_reward.py:NOT_A_FUNCTION", "rollout.reward: '{dir}/my_reward.py:NOT_A_FUNCTION' is a float, not a "
                                        "function"),
        ("my_reward.py:one_argument", "rollout.reward: one_argument(completion_text) cannot take the arguments"),
    ],
)
def test_a_reward_that_cannot_be_used_is_refused_at_load(tmp_path, model_dir, reward, fragment):
    (tmp_path / "my_reward.py").write_text(REWARDS)
    cfg = write_config(tmp_path, model_dir, rollout={"reward": reward})
    proc, took = train(tmp_path, cfg, timeout=60)
    assert proc.returncode == 2
    fragment = fragment.format(dir=tmp_path).replace("'my_reward.py'", f"'{tmp_path}/my_reward.py'")
    assert fragment in proc.stderr, proc.stderr
    assert not run_dir(tmp_path).exists() and took < 30  # refused before anything started


def test_multi_turn_asks_again_after_a_wrong_answer(tmp_path, model_dir):
    """rollout.workflow=multi_turn with a parity reward (right about half the time on the tiny model),
    in a rollout worker process (the workflow is pickled there): a conversation whose first answer
    scored below 1 has a second turn, one whose first answer scored 1 has one; each item's
    gen.n_samples conversations are one group."""
    dump = tmp_path / "dump"
    cfg = config(tmp_path, model_dir, "parity", rollout={"workflow": "multi_turn", "dump_dir": str(dump),
                                                         "workers": 1})
    proc, _ = train(tmp_path, cfg)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [r["step"] for r in rl_rows(tmp_path)] == [1, 2]
    trajs = [t for path in sorted(dump.glob("*.jsonl")) for t in read_dump(path)]
    assert len(trajs) >= 16  # 2 steps x 4 groups x 2 conversations
    groups: dict[str, list] = {}
    for t in trajs:
        groups.setdefault(t.group_id, []).append(t)
        turns = t.info["turn_rewards"]
        assert t.num_turns == len(turns) == (1 if turns[0] >= 1.0 else 2)
        assert t.reward == turns[-1]
    assert {len(g) for g in groups.values()} == {2}
    assert all(len({t.prompt_id for t in g}) == 1 for g in groups.values())
    two = [t for t in trajs if t.num_turns == 2]
    assert two, "no conversation needed a second turn"
    for t in two:  # two generated spans with the retry message between them
        spans = sum(1 for i, m in enumerate(t.loss_mask) if m and (i == 0 or not t.loss_mask[i - 1]))
        assert spans == 2

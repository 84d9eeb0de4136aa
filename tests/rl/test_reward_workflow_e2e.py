"""`rollout.reward` from a file and `rollout.workflow` in real `tandem train` runs (tiny model,
one server, one trainer rank, 2 steps): the user's function scores training and evaluation in the
reward pool; one that raises or hangs on some items has those episodes rejected while the run
completes, and those evaluation items count as wrong; one that fails on every training item ends
the run through the error storm with its error; a reward that cannot be used stops `tandem train`
at load time (exit 2); the multi_turn workflow asks again after a wrong answer.

Three runs serve every test here (module fixtures, each run once and read by several tests):
`scored` (rlvr; a reward that scores, raises or spins depending on the item), `storm` (every
training reward raises; evaluation items raise or score) and `conversations`
(multi_turn in a rollout worker). A reward that cannot be used needs no run: `tandem train`'s
`main` refuses it in this process."""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from tandem.cli import main
from tandem.data.tasks import get_task
from tandem.rollout.dump import read_dump
from tests.launch.procs import CHILD_ENV
from tests.rl.common import TANDEM, rl_rows, run_dir, write_config

pytestmark = pytest.mark.slow

SEED = 1  # experiment.seed's default: which items the run draws
TRAIN_ITEMS = get_task("arithmetic", difficulty="add1", instruction=False).generate(64, seed=SEED, split="train")
EVAL_ITEMS = get_task("arithmetic", difficulty="add1", instruction=False).generate(8, seed=SEED, split="eval")
# The training items `graded` spins on: answers 0 mod 4 among the stream's first 16 (positions
# 0, 1, 10 and 12), all done with before the last training step, so before the last evaluation.
# The evaluation shares the reward pool, and each call's timeout counts from its submission: an
# eval call queued behind spins on a loaded machine would time out and fail.
SPIN = frozenset(i["expression"] for i in TRAIN_ITEMS[:16] if int(i["answer"]) % 4 == 0)

REWARDS = '''
import os
import time
from pathlib import Path


def graded(prompt_text, completion_text, prompt_ids, completion_ids, answer, expression, split="train",
           **fields):
    """Evaluation, and training items with odd answers: 0.25 + tokens / 1000 (no task reward gives
    that). Other training items raise, except those in SPIN, which spin until the timeout stops them.
    An evaluation call notes which reward worker ran it, and takes 0.5 s so that calls overlap."""
    if split == "eval":
        with Path(__file__).with_name("reward-pids.txt").open("a") as f:
            f.write(f"{os.getpid()}\\n")
        time.sleep(0.5)
    if split == "eval" or int(answer) % 2 == 1:
        return 0.25 + len(completion_ids) / 1000
    if expression not in SPIN:
        raise RuntimeError(f"cannot grade the even answer {answer}")
    while True:
        pass


def storm(prompt_text, completion_text, prompt_ids, completion_ids, answer, split="train", **fields):
    """Training: every call raises. Evaluation: even answers raise, odd ones score 1."""
    if split == "train":
        raise RuntimeError("grader exploded")
    if int(answer) % 2 == 0:
        raise RuntimeError(f"cannot grade the even answer {answer}")
    return 1.0


def parity(prompt_text, completion_text, prompt_ids, completion_ids, **fields):
    return float(bool(completion_ids) and completion_ids[-1] % 2 == 0)


NOT_A_FUNCTION = 0.5


def one_argument(completion_text):
    return 1.0
''' + f"\n\nSPIN = {SPIN!r}\n"


def config(root: Path, model: Path, reward: str, **sections: dict) -> Path:
    """A small run whose config names `my_reward.py:<reward>` relative to the config file's directory."""
    (root / "my_reward.py").write_text(REWARDS)
    rollout = {"backend": "tandem:d1", "reward": f"my_reward.py:{reward}", **sections.pop("rollout", {})}
    return write_config(root, model, actor={"backend": "archon:d1"}, rollout=rollout, **sections)


@dataclass
class Run:
    """One finished `tandem train`: where it wrote, how it ended, how long it took."""

    root: Path
    proc: subprocess.CompletedProcess
    took: float

    @property
    def err(self) -> str:
        return self.proc.stderr

    def succeeded(self) -> None:
        assert self.proc.returncode == 0, self.err[-3000:]

    def rows(self) -> list[dict]:
        return [json.loads(line) for line in (run_dir(self.root) / "metrics.jsonl").read_text().splitlines()]

    def eval_rows(self) -> list[dict]:
        return [r for r in self.rows() if "eval/accuracy" in r]


def train(root: Path, cfg: Path, timeout: float = 240) -> Run:
    """`tandem train cfg` from another working directory (the reward file is found from the config's)."""
    elsewhere = root / "elsewhere"
    elsewhere.mkdir(exist_ok=True)
    began = time.monotonic()
    proc = subprocess.run([TANDEM, "train", str(cfg)], capture_output=True, text=True, timeout=timeout,
                          cwd=elsewhere, env={**os.environ, **CHILD_ENV})
    took = time.monotonic() - began
    print(f"tandem train: exit {proc.returncode} after {took:.1f}s")
    return Run(root, proc, took)


def timed_out(name: str) -> str:
    """The error of a call stopped at task.reward_timeout_s=1: by the worker's own timer, or (when
    the pool's fresh worker spent part of the second starting, as on a loaded machine) by the
    hard deadline a second later, which kills the worker."""
    return (rf"my_reward\.py:{name}: (reward 'my_reward\.py:{name}' ran past 1s|timed out after 1s) "
            rf"\(the timeout, task\.reward_timeout_s\)")


@pytest.fixture(scope="module")
def scored(tmp_path_factory, model_dir) -> Run:
    """rlvr with `graded`: odd training answers score, the SPIN items spin, other even ones raise;
    every eval item scores. Three reward workers (task.reward_workers; the default is 2)."""
    root = tmp_path_factory.mktemp("scored")
    return train(root, config(root, model_dir, "graded", task={"reward_timeout_s": 1.0, "reward_workers": 3}))


@pytest.fixture(scope="module")
def storm(tmp_path_factory, model_dir) -> Run:
    """rlvr with `storm`: every training call raises (the storm ends the run after 4 failed
    episodes); in the step-0 evaluation some items raise, the others score. No reward here waits
    for task.reward_timeout_s: on a loaded machine a 1 s timeout can also stop a call that raises
    at once (a fresh worker's start counts), and the first error would be that timeout."""
    root = tmp_path_factory.mktemp("storm")
    return train(root, config(root, model_dir, "storm", rollout={"max_consecutive_failures": 4}))


@pytest.fixture(scope="module")
def conversations(tmp_path_factory, model_dir) -> Run:
    """multi_turn with `parity` in a rollout worker process, its episodes dumped."""
    root = tmp_path_factory.mktemp("conversations")
    cfg = config(root, model_dir, "parity", rollout={"workflow": "multi_turn", "dump_dir": str(root / "dump"),
                                                     "workers": 1})
    return train(root, cfg)


def test_a_reward_from_a_file_scores_training_and_evaluation(scored):
    """Catches: the file's function not used (the task's 0/1 reward instead), not used in
    evaluation, or not given the generated ids (0.25 + tokens/1000 holds only with them); the
    recorded config keeping a relative path (the run could not be rerun from elsewhere); rewards
    computed in other than task.reward_workers worker processes."""
    scored.succeeded()
    # The step-0 evaluation (its 8 calls come first, before any training reward could stop a
    # worker) runs in 3 worker processes: task.reward_workers.
    assert len(set((scored.root / "reward-pids.txt").read_text().split()[:8])) == 3
    rows = rl_rows(scored.root)
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:  # 0.25 + tokens / 1000 over the trained (odd-answer) episodes
        assert r["reward/mean"] == pytest.approx(0.25 + r["gen/response_len_mean"] / 1000, abs=1e-6)
    evals = scored.eval_rows()
    assert [r["step"] for r in evals] == [0, 2]
    for r in evals:  # every eval item, the even ones included (split == "eval"), scores
        assert r["eval/failed"] == 0
        assert r["eval/accuracy"] == pytest.approx(0.25 + r["eval/response_len"] / 1000, abs=1e-6)
    recorded = (run_dir(scored.root) / "config.yaml").read_text()
    assert f"reward: {scored.root}/my_reward.py:graded" in recorded  # absolute: the run can be rerun anywhere


def test_a_reward_that_raises_on_some_items_rejects_those_episodes(scored):
    """Even answers (but SPIN's) make `graded` raise: those episodes fail and are rejected (logged as such,
    with the error), so the items the steps trained (`data/prompt_ids`, stream positions) never
    have such answers; the run completes. Catches a raising reward that fails the run, or whose
    episode is trained anyway."""
    scored.succeeded()
    assert re.search(r"episode \d+ failed and is rejected .*my_reward\.py:graded: RuntimeError: cannot grade the "
                     r"even answer", scored.err), scored.err[-3000:]
    rows = rl_rows(scored.root)
    trained = [int(TRAIN_ITEMS[i % 64]["answer"]) for r in rows for i in r["data/prompt_ids"]]
    assert len(trained) == 8 and all(a % 2 == 1 for a in trained), trained
    assert rows[-1]["rollout/failed"] > 0


def test_a_reward_that_spins_on_some_items_times_out_there_and_the_run_completes(scored):
    """`while True: pass` on the SPIN items: those calls are stopped at task.reward_timeout_s and
    their episodes failed and rejected (the path that also counts towards the error storm, see
    `test_a_raising_reward_ends_the_run_with_its_error`); the other items train and the run
    completes in bounded time. Catches a spinning reward that blocks the run, or whose episode is
    trained anyway or dropped without failing."""
    scored.succeeded()
    assert re.search(r"episode \d+ failed and is rejected .*" + timed_out("graded"), scored.err), scored.err[-3000:]
    rows = rl_rows(scored.root)
    assert [r["step"] for r in rows] == [1, 2]
    trained = [TRAIN_ITEMS[i % 64]["expression"] for r in rows for i in r["data/prompt_ids"]]
    assert len(trained) == 8 and not SPIN & set(trained), trained
    assert scored.took < 200


def test_a_raising_reward_ends_the_run_with_its_error(storm):
    """Every training reward raises: after rollout.max_consecutive_failures failed episodes in a
    row the run ends (exit 2) naming the first error, with bounded output: each distinct error's
    traceback once, not one per episode. Catches a storm that never ends the run (it would train
    on nothing until the timeout), one that ends it without the reward's error, or a flood of
    tracebacks."""
    err = storm.err
    assert storm.proc.returncode == 2, err[-3000:]
    assert ("4 episodes in a row failed (rollout.max_consecutive_failures); the first error: RewardError: 2/2 "
            "rewards of the group failed; the first: my_reward.py:storm: RuntimeError: grader exploded") in err
    assert err.count("Traceback") <= 2, err[-5000:]
    assert len(err) < 20_000 and storm.took < 200  # bounded (a loaded CI machine takes ~80 s)


def test_evaluation_rewards_that_fail_count_those_items_wrong(storm):
    """The step-0 evaluation of `storm`: each item whose reward raises counts as wrong, with its
    error logged, and the others score: accuracy = (n - failed) / n; the run goes on to training.
    Catches a failing eval reward that ends the run or counts as anything but 0, or one failure
    that fails the whole evaluation. (A reward that hangs in evaluation: test_run_lifecycle.py's
    `test_failing_evaluation_rewards_count_as_wrong`.)"""
    err = storm.err
    assert storm.proc.returncode == 2, err[-3000:]  # the storm ended it, after the evaluation
    even = [int(i["answer"]) for i in EVAL_ITEMS if int(i["answer"]) % 2 == 0]
    assert 0 < len(even) < len(EVAL_ITEMS) == 8  # the items hold both cases
    for answer in even:
        assert f"counts as wrong: my_reward.py:storm: RuntimeError: cannot grade the even answer {answer}" in err
    assert f"eval: {len(even)} of 8 items failed and count as wrong" in err
    assert "episodes in a row failed" in err  # training started after the evaluation
    (first,) = storm.eval_rows()
    assert first["step"] == 0 and first["eval/failed"] == len(even) and first["eval/n"] == 8
    assert first["eval/accuracy"] == (8 - len(even)) / 8


def test_multi_turn_asks_again_after_a_wrong_answer(conversations):
    """rollout.workflow=multi_turn with a parity reward (right about half the time on the tiny model),
    in a rollout worker process (the workflow is pickled there): a conversation whose first answer
    scored below 1 has a second turn, one whose first answer scored 1 has one; each item's
    gen.n_samples conversations are one group."""
    conversations.succeeded()
    assert [r["step"] for r in rl_rows(conversations.root)] == [1, 2]
    dump = conversations.root / "dump"
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
def test_a_reward_that_cannot_be_used_is_refused_at_load(tmp_path, model_dir, monkeypatch, capsys, reward, fragment):
    """`tandem train` (its `main`, in this process, from another working directory: the file is
    looked for next to the config) exits 2 with the message naming rollout.reward, before anything
    started: no run directory, and the launch (`plan_trial`, where every run begins) never reached.
    Catches a reward mistake found only once the run is under way, or not at all."""
    (tmp_path / "my_reward.py").write_text(REWARDS)
    cfg = write_config(tmp_path, model_dir, rollout={"reward": reward})
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")

    def launched(*args, **kwargs):
        raise AssertionError("the config was accepted: the run would start")

    monkeypatch.setattr("tandem.rl.trial.plan_trial", launched)
    assert main(["train", str(cfg)]) == 2
    err = capsys.readouterr().err
    fragment = fragment.format(dir=tmp_path).replace("'my_reward.py'", f"'{tmp_path}/my_reward.py'")
    assert f"tandem train: error: {fragment}" in err, err
    assert not run_dir(tmp_path).exists()

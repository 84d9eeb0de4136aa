"""Rewards that ask for the sandbox (a `sandbox` parameter) get one in their reward worker: the
runner's `sandbox=` limits (rollout.sandbox), executions ended by the call's timeout
(task.reward_timeout_s) as for any reward, nothing left running, and a sandbox that cannot run
failing each call with its reason, which the executor's error storm then ends the run with."""

from __future__ import annotations

import os
import time

import pytest

from tandem.data.tasks import get_task
from tandem.rollout import (
    ExecutorConfig,
    GenerationParams,
    InferenceClient,
    RewardRunner,
    RLVRWorkflow,
    WorkflowExecutor,
)
from tandem.rollout.errors import EpisodeFailureStorm
from tandem.rollout.reward import wants_sandbox
from tandem.sandbox import SandboxConfig
from tandem.user_code import UserFunction
from tests.rollout import rewards
from tests.rollout.conftest import run
from tests.sandbox.conftest import bwrap_missing, sandbox_processes

pytestmark = [pytest.mark.timeout(120), pytest.mark.skipif(bwrap_missing() is not None, reason=str(bwrap_missing()))]
UID_BASE = 400000 + (os.getpid() % 4000) * 16  # this test process's sandbox uids (leased from here up)


def limits(**changes) -> SandboxConfig:
    return SandboxConfig(**{"workers": 2, "cpu_s": 2.0, "wall_s": 5.0, "uid_base": UID_BASE, **changes})


def score(runner: RewardRunner, fn, completion: str = "", **fields):
    return run(runner.ascore(fn, "p", completion, [1], [2], **fields), timeout=60.0)


def programs_left() -> list:
    return [p for p in sandbox_processes(range(UID_BASE, UID_BASE + 16)) if "main.py" in p[2]]


def test_which_rewards_ask_for_the_sandbox(tmp_path):
    (tmp_path / "mine.py").write_text("def score(prompt_text, completion_text, prompt_ids, completion_ids, sandbox, "
                                      "**fields):\n    return 1.0\n")
    assert wants_sandbox(rewards.sandboxed_reward) and wants_sandbox(UserFunction(f"{tmp_path}/mine.py:score"))
    assert wants_sandbox(get_task("code").reward_fn())
    assert not wants_sandbox(rewards.parity_reward) and not wants_sandbox(get_task("arithmetic").reward_fn())


def test_a_reward_file_that_cannot_be_imported_fails_its_calls_not_the_caller(tmp_path):
    """Asking whether it wants the sandbox imports the file in the caller: an error there must be
    the call's failure (as the worker reports it), not an exception out of ascore."""
    (tmp_path / "broken.py").write_text("raise RuntimeError('the grader cannot load its data')\n")
    fn = UserFunction(f"{tmp_path}/broken.py:score")
    assert not wants_sandbox(fn)
    runner = RewardRunner(max_workers=1, timeout_s=20.0)
    try:
        res = score(runner, fn)
        assert res.value is None and "RuntimeError: the grader cannot load its data" in res.error, res
    finally:
        runner.close()


def test_the_code_tasks_reward_runs_in_the_workers_sandbox_with_the_runners_limits():
    """The reference scores 1.0 and a wrong program 0.0; a program that sleeps 3 s scores 0.0 within
    the runner's wall_s of 1 s (the default 10 s would have let it finish: the limits reached the
    worker's sandbox)."""
    task = get_task("code", difficulty="easy")
    item = task.generate(1, seed=3)[0]
    fields = {k: v for k, v in item.items() if k not in ("id", "prompt", "messages")}
    runner = RewardRunner(max_workers=1, timeout_s=20.0, sandbox=limits(wall_s=1.0))
    try:
        assert score(runner, task.reward_fn(), task.sft_target(item), **fields).value == 1.0
        wrong = "```python\ndef f(x):\n    return -1\n```"
        assert score(runner, task.reward_fn(), wrong, **fields).value == 0.0
        sleepy = "```python\nimport time\ntime.sleep(3)\n" + item["solution"] + "\n```"
        start = time.monotonic()
        res = score(runner, task.reward_fn(), sleepy, **fields)
        assert res.value == 0.0 and time.monotonic() - start < 2.9 * 2, res  # 4 tests, 2 at a time, 1 s each
    finally:
        runner.close()
    assert not programs_left()


def test_a_user_reward_that_asks_for_the_sandbox_gets_it(tmp_path):
    (tmp_path / "my_reward.py").write_text(
        "def score(prompt_text, completion_text, prompt_ids, completion_ids, *, sandbox, tests, **fields):\n"
        "    return sandbox.run(completion_text, tests).fraction\n")
    fn = UserFunction(f"{tmp_path}/my_reward.py:score")
    runner = RewardRunner(max_workers=1, timeout_s=20.0, sandbox=limits())
    try:
        tests = ["assert f(1) == 2", "assert f(2) == 3", "assert f(3) == 5", {"input": "", "output": ""}]
        assert score(runner, fn, "def f(x):\n    return x + 1\n", tests=tests).value == 0.75
    finally:
        runner.close()


def test_a_program_past_the_reward_timeout_fails_the_call_and_is_killed_with_it():
    """task.reward_timeout_s bounds a sandboxed reward as any other: the call fails with the usual
    message at 1.5 s, though the program's own wall limit is 30 s, and the program is gone."""
    runner = RewardRunner(max_workers=1, timeout_s=1.5, timeout_key="task.reward_timeout_s",
                          sandbox=limits(wall_s=30.0, cpu_s=30.0))
    try:
        assert score(runner, rewards.sandboxed_reward, program="print(1)").value == 1.0  # the worker is up
        start = time.monotonic()
        res = score(runner, rewards.sandboxed_reward, program="while True:\n    pass\n")
        took = time.monotonic() - start
        assert res.value is None and "ran past 1.5s (the timeout, task.reward_timeout_s)" in res.error, res
        assert took < 10.0, took
        deadline = time.monotonic() + 5.0
        while programs_left():  # the execution ended at the call's deadline, and its tree with it
            assert time.monotonic() < deadline, programs_left()
            time.sleep(0.05)
        assert score(runner, rewards.sandboxed_reward, program="print(1)").value == 1.0  # and the worker serves on
        assert runner.num_recycled == 0
    finally:
        runner.close()


def test_a_sandbox_that_cannot_run_fails_each_call_and_the_storm_ends_the_rollouts(make_server):
    """bwrap gone: every sandboxed reward fails naming it (never running the program unisolated), and
    after rollout.max_consecutive_failures episodes in a row the executor stops with that error."""
    runner = RewardRunner(max_workers=1, timeout_s=20.0, sandbox=limits(bwrap="/nonexistent/bwrap"))
    server = make_server()
    ex = WorkflowExecutor(InferenceClient([server.address]),
                          ExecutorConfig(max_concurrent_rollouts=2, consumer_batch_size=2, max_consecutive_failures=4))
    wf = RLVRWorkflow(rewards.sandboxed_reward, GenerationParams(max_new_tokens=2), n_samples=2, reward_runner=runner)
    try:
        res = score(runner, rewards.sandboxed_reward, program="open('/tmp/ran', 'w')")
        assert res.value is None and "bubblewrap '/nonexistent/bwrap' was not found" in res.error, res
        items = ({"input_ids": [i + 1], "id": str(i), "program": "print(1)"} for i in range(1000))
        with pytest.raises(EpisodeFailureStorm) as info:
            ex.prepare_batch(items, wf, timeout=60)
        assert info.value.count == 4 and "SandboxUnavailable" in info.value.first_error
        assert "/nonexistent/bwrap" in info.value.first_error
    finally:
        ex.shutdown()
        runner.close()

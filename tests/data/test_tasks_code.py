"""The code task: generated problems whose references pass their own tests (checked by plain
Python, independently of the sandbox, and by the task's sandboxed reward), disjoint splits, the
teacher's slip, code extraction, scoring (all, fraction, format weight), hostile completions, and
problems from a local file."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tandem.data.tasks import TaskError, extract_code, get_task
from tandem.data.tasks.code import FAMILIES, PRESETS
from tandem.sandbox import Sandbox, SandboxConfig
from tests.sandbox.conftest import bwrap_missing, sandbox_processes

needs_sandbox = pytest.mark.skipif(bwrap_missing() is not None, reason=str(bwrap_missing()))
UID_BASE = 500000 + (os.getpid() % 4000) * 16


def sandbox(**changes) -> Sandbox:
    return Sandbox(SandboxConfig(**{"workers": 2, "cpu_s": 2.0, "wall_s": 5.0, "uid_base": UID_BASE, **changes}))


def passes_in_plain_python(program: str, tests: list) -> list[bool]:
    """The oracle: each test run by the host's Python, without the sandbox."""
    out = []
    for test in tests:
        if isinstance(test, dict):
            proc = subprocess.run([sys.executable, "-c", program], input=test["input"], capture_output=True,
                                  text=True, timeout=30)
            out.append(proc.returncode == 0 and proc.stdout == test["output"])
        else:
            scope: dict = {}
            try:
                exec(program, scope)
                exec(test, scope)
                out.append(True)
            except AssertionError:
                out.append(False)
    return out


@pytest.mark.parametrize("io", ["function", "stdio"])
def test_every_familys_reference_passes_its_tests_and_the_slip_fails(io):
    """Each family: 3 problems whose reference passes all 4 tests in plain Python, and whose
    slipped target (the last operation left out) fails at least one."""
    for name in FAMILIES:
        task = get_task("code", families=[name], io=io, teacher_slip=1.0)
        for item in task.generate(3, seed=1):
            assert item["task"] == "code" and item["answer"] == item["solution"] and len(item["tests"]) == 4
            assert all(passes_in_plain_python(item["solution"], item["tests"])), item
            slipped = extract_code(task.sft_target(item))
            assert slipped != item["solution"] and not all(passes_in_plain_python(slipped, item["tests"])), item


def test_problems_are_reproducible_and_the_splits_disjoint():
    task = get_task("code", difficulty="hard", io="mixed")
    train, evals = task.generate(300, seed=0), task.generate(60, seed=0, split="eval")
    assert train == task.generate(300, seed=0) and train != task.generate(300, seed=1)
    assert not {i["prompt"] for i in train} & {i["prompt"] for i in evals}
    assert len({i["prompt"] for i in train}) == 300  # no repeats while new problems remain
    assert {i["io"] for i in train} == {"function", "stdio"} and {i["family"] for i in train} == set(FAMILIES)
    assert json.loads(json.dumps(train)) == train  # plain values: they pickle into reward workers
    easy = get_task("code").generate(50, seed=0)
    assert {i["family"] for i in easy} == set(PRESETS["easy"])
    assert easy[0]["prompt"].endswith("Answer with the code in a ```python block.")
    assert not get_task("code", instruction=False).generate(1)[0]["prompt"].endswith("block.")


def test_extract_code_takes_the_last_closed_python_block():
    assert extract_code("```python\na = 1\n```\ntext\n```py\nb = 2\n```") == "b = 2\n"
    assert extract_code("```\nc = 3\n```") == "c = 3\n"
    assert extract_code("```Python3\nd = 4\n```") == "d = 4\n"
    assert extract_code("```python\ne = 5\n```\n```bash\nls\n```") == "e = 5\n"  # another language is not code
    assert extract_code("```python\nunclosed = 1\n") is None
    assert extract_code("def f(x):\n    return x\n") is None


@needs_sandbox
def test_reward_scores_all_fraction_and_format_weight():
    """A program that passes exactly one of the four tests: 0.0 with scoring all, 0.25 with fraction,
    and with format_weight 0.2 those become 0.2 and 0.4; no block is 0.0 whatever the weight."""
    box = sandbox()
    item = get_task("code").generate(1, seed=2)[0]
    first = item["tests"][0]  # "assert f(A) == B"
    arg, expected = first.removeprefix("assert f(").split(") == ")
    one = f"```python\ndef f(x):\n    return {expected} if x == {arg} else -10**9\n```"
    reference = f"```python\n{item['solution']}\n```"
    for options, want in (({}, 0.0), ({"scoring": "fraction"}, 0.25), ({"format_weight": 0.2}, 0.2),
                          ({"scoring": "fraction", "format_weight": 0.2}, 0.4)):
        task = get_task("code", **options)
        assert task.reward(one, item, box) == pytest.approx(want), options
        assert task.reward(reference, item, box) == 1.0
        assert task.reward(item["solution"], item, box) == 0.0  # no fenced block
    rewarded = get_task("code").reward_fn()("p", reference, [1], [2], sandbox=box, **item)
    assert rewarded == 1.0


@needs_sandbox
@pytest.mark.parametrize("program", [
    "import os\nwhile True:\n    os.fork()\n",
    "while True:\n    pass\n",
    "x = bytearray(10 * 2**30)\n",
    "print('x' * 10**8)\n",
    "import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\n",
], ids=["fork-bomb", "busy-loop", "10GB", "100MB-stdout", "kill-parent"])
def test_hostile_completions_score_zero_and_leave_nothing(program):
    item = get_task("code").generate(1, seed=0)[0]
    box = sandbox()
    assert get_task("code", scoring="fraction").reward(f"```python\n{program}```", item, box) == 0.0
    assert not [p for p in sandbox_processes(range(UID_BASE, UID_BASE + 16)) if "main.py" in p[2]]
    assert get_task("code").reward(f"```python\n{item['solution']}\n```", item, box) == 1.0  # still serving


@needs_sandbox
def test_problems_from_a_file(tmp_path):
    """A generic-layout file with assert and stdin/stdout problems: split by a hash of the prompt
    (or a second file as the eval split), each reference scoring 1.0 through the task."""
    rows = [{"prompt": f"Write add{k}(x), x plus {k}.", "solution": f"def add{k}(x):\n    return x + {k}\n",
             "tests": [f"assert add{k}(1) == {1 + k}", f"assert add{k}(5) == {5 + k}"]} for k in range(12)]
    rows += [{"prompt": f"Print the input times {k}.", "solution": f"print(int(input()) * {k})",
              "tests": [{"input": "3\n", "output": f"{3 * k}\n"}]} for k in range(12)]
    path = tmp_path / "problems.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    task = get_task("code", train_file=str(path), eval_fraction=0.3)
    train, evals = task.generate(seed=0), task.generate(seed=0, split="eval")
    assert len(train) + len(evals) == 24 and evals and not {i["prompt"] for i in train} & {i["prompt"] for i in evals}
    assert len(task.generate(50, seed=0)) == 50  # rows repeat past the end
    box = sandbox()
    for item in train[:4] + evals[:2]:
        assert task.reward(task.sft_target(item), item, box) == 1.0, item
    whole = get_task("code", train_file=str(path), eval_file=str(path))
    assert len(whole.generate(split="eval")) == 24


def test_options_are_checked():
    for options, message in (({"difficulty": "expert"}, "unknown difficulty 'expert'"),
                             ({"families": ["add", "pow"]}, "families must be a non-empty list"),
                             ({"io": "files"}, "io must be one of"),
                             ({"scoring": "half"}, "scoring must be 'all'"),
                             ({"teacher_slip": 2}, "teacher_slip must be in [0, 1]"),
                             ({"eval_file": "x.jsonl"}, "eval_file needs a train_file")):
        with pytest.raises(TaskError, match=message.replace("[", r"\[").replace("]", r"\]")):
            get_task("code", **options)
    with pytest.raises(TaskError, match="give n"):
        get_task("code").generate()


@needs_sandbox
def test_a_program_met_again_is_not_run_again_unless_it_timed_out(monkeypatch):
    """The reward's cache of verdicts: the same program on the same tests under the same limits runs
    once per process; other limits, or a verdict that timed out, run again."""
    from tandem.sandbox import session

    runs = []
    real = session.Sandbox.run

    def counted(self, code, tests):
        runs.append(code)
        return real(self, code, tests)

    monkeypatch.setattr(session.Sandbox, "run", counted)
    item = get_task("code").generate(1, seed=4)[0]
    task = get_task("code", scoring="fraction")
    answer = f"```python\n{item['solution']}\n```"
    assert [task.reward(answer, item, sandbox()) for _ in range(3)] == [1.0, 1.0, 1.0]
    assert len(runs) == 1
    assert task.reward(answer, item, sandbox(wall_s=4.0)) == 1.0 and len(runs) == 2
    slow = "```python\nimport time\ntime.sleep(5)\n```"
    assert [task.reward(slow, item, sandbox(wall_s=1.0)) for _ in range(2)] == [0.0, 0.0]
    assert len(runs) == 4  # timed out: run each time

"""Programming problems whose reward runs the model's code against unit tests in the sandbox.

Items come from a generator of verifiable Python problems (families of small functions or stdin/stdout
programs with a parameter: "Write a Python function f(x) that returns 3 times x plus 7.") or from
local files in the common formats of code-RL sets (`code_files.load_code_file`). Each item has the
reference `solution` (also its `answer`) and `tests`: assert statements, or {"input", "output"}
pairs. The reward extracts the completion's last fenced code block and runs it against the tests,
one sandboxed execution per test (`tandem.sandbox`): the share of tests passed (`scoring:
fraction`) or 1.0 only when all pass (`scoring: all`). No block scores 0; with `format_weight` w a
block scores w + (1 - w) * score. See docs/tasks.md, "code"."""

from __future__ import annotations

import json
import random
import re
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tandem.data.tasks.base import Task, TaskError, check_fraction, cycled_order, normalize_split
from tandem.data.tasks.code_files import load_code_file
from tandem.data.tasks.files import split_rows
from tandem.sandbox import Sandbox

INSTRUCTION = "Answer with the code in a ```python block."
SCORINGS = ("all", "fraction")
IO_STYLES = ("function", "stdio", "mixed")
_FENCE = re.compile(r"```[ \t]*(python3?|py)?[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)
_TEST_INPUTS = 4  # tests per generated problem


def extract_code(completion_text: str) -> str | None:
    """The contents of the last closed fenced block tagged python, python3, py or untagged; None
    when there is none (an unclosed block, one in another language, plain text)."""
    blocks = [m.group(2) for m in _FENCE.finditer(completion_text)]
    return blocks[-1] if blocks else None


@dataclass(frozen=True)
class Family:
    """A kind of generated problem: `what` completes "returns ..." / "prints ..." given the
    parameters, `expr` is the Python expression of the result (of `x`, or of `xs`), `slip` the
    expression with its last operation left out (a weak teacher's program)."""

    name: str
    arg: str  # "x": an integer; "xs": a list of integers
    what: str
    expr: str
    slip: str
    params: Callable[[random.Random], dict[str, int]]


def _k(lo: int, hi: int) -> Callable[[random.Random], dict[str, int]]:
    return lambda rng: {"k": rng.randint(lo, hi)}


def _ab(rng: random.Random) -> dict[str, int]:
    return {"a": rng.randint(2, 9), "b": rng.randint(1, 99)}


FAMILIES: dict[str, Family] = {f.name: f for f in (
    Family("add", "x", "x plus {k}", "x + {k}", "x", _k(1, 99)),
    Family("sub", "x", "x minus {k}", "x - {k}", "x", _k(1, 99)),
    Family("mul", "x", "x times {k}", "x * {k}", "x", _k(2, 99)),
    Family("linear", "x", "{a} times x plus {b}", "{a} * x + {b}", "{a} * x", _ab),
    Family("mod", "x", "the remainder of x divided by {k}", "x % {k}", "x", _k(2, 99)),
    Family("sum_above", "xs", "the sum of the numbers in xs greater than {k}", "sum(v for v in xs if v > {k})",
           "sum(xs)", _k(0, 50)),
    Family("count", "xs", "how many numbers in xs equal {k}", "xs.count({k})", "len(xs)", _k(0, 5)),
    Family("max_plus", "xs", "the largest number in xs plus {k}", "max(xs) + {k}", "max(xs)", _k(1, 99)),
    Family("scale", "xs", "the list of the numbers in xs each times {k}", "[v * {k} for v in xs]", "xs", _k(2, 9)),
)}

# Ordered from easiest to hardest.
PRESETS: dict[str, tuple[str, ...]] = {
    "easy": ("add", "sub", "mul"),
    "linear": ("linear",),
    "medium": ("add", "sub", "mul", "linear", "mod"),
    "lists": ("sum_above", "count", "max_plus", "scale"),
    "hard": tuple(FAMILIES),
}


def _problem_text(family: Family, params: dict[str, int], io: str) -> str:
    what = family.what.format(**params)
    if io == "stdio":
        reads = "an integer x" if family.arg == "x" else "integers xs, separated by spaces, on one line"
        return f"Write a Python program that reads {reads} from stdin and prints {what}."
    return f"Write a Python function f({family.arg}) that returns {what}."


def _program(family: Family, expr: str, io: str) -> str:
    if io == "stdio":
        read = "x = int(input())" if family.arg == "x" else "xs = [int(v) for v in input().split()]"
        return f"{read}\nprint({expr})"
    return f"def f({family.arg}):\n    return {expr}"


def _inputs(family: Family, rng: random.Random) -> list[Any]:
    if family.arg == "x":
        return rng.sample(range(0, 100), _TEST_INPUTS)
    high = 5 if family.name == "count" else 99  # count: small values, so that k occurs
    return [[rng.randint(0, high) for _ in range(rng.randint(1, 6))] for _ in range(_TEST_INPUTS)]


def _tests(family: Family, params: dict[str, int], io: str, rng: random.Random) -> list[Any]:
    """Tests on inputs that tell the reference from the teacher's slip (redrawn until one does),
    so that no test set passes a program that leaves the last operation out."""
    expr, slip = family.expr.format(**params), family.slip.format(**params)

    def value(e: str, arg: Any) -> Any:
        return eval(e, {}, {family.arg: arg})  # our own expression on our own integers

    for _ in range(1000):
        inputs = _inputs(family, rng)
        if any(value(expr, v) != value(slip, v) for v in inputs):
            break
    tests: list[Any] = []
    for v in inputs:
        expected = value(expr, v)
        if io == "stdio":
            line = str(v) if family.arg == "x" else " ".join(map(str, v))
            tests.append({"input": line + "\n", "output": f"{expected}\n"})
        else:
            tests.append(f"assert f({v!r}) == {expected!r}")
    return tests


class CodeTask(Task):
    name = "code"

    def __init__(
        self,
        difficulty: str = "easy",
        families: list[str] | None = None,
        io: str = "function",
        scoring: str = "all",
        train_file: str | None = None,
        eval_file: str | None = None,
        cache_dir: str | None = None,
        instruction: bool = True,
        eval_fraction: float = 0.2,
        format_weight: float = 0.0,
        system_prompt: str | None = None,
        teacher_slip: float = 0.0,
    ):
        super().__init__(system_prompt=system_prompt, format_weight=format_weight)
        if difficulty not in PRESETS:
            raise TaskError(f"code: unknown difficulty {difficulty!r}; presets: {', '.join(PRESETS)}")
        names = list(families) if families is not None else list(PRESETS[difficulty])
        unknown = [n for n in names if n not in FAMILIES]
        if unknown or not names:
            raise TaskError(f"code: families must be a non-empty list of {', '.join(FAMILIES)}; got {families!r}")
        if io not in IO_STYLES:
            raise TaskError(f"code: io must be one of {', '.join(IO_STYLES)}, got {io!r}")
        if scoring not in SCORINGS:
            raise TaskError(f"code: scoring must be 'all' (1.0 only when every test passes) or 'fraction' "
                            f"(the share passed), got {scoring!r}")
        if not 0.0 <= teacher_slip <= 1.0:
            raise TaskError(f"code: teacher_slip must be in [0, 1] (a share of SFT targets), got {teacher_slip!r}")
        if eval_file is not None and train_file is None:
            raise TaskError("code: eval_file needs a train_file (the training problems)")
        self.difficulty = difficulty
        self.families = names
        self.io = io
        self.scoring = scoring
        self.train_file = train_file
        self.eval_file = eval_file
        self.cache_dir = cache_dir
        self.instruction = instruction
        self.eval_fraction = check_fraction(eval_fraction)
        self.teacher_slip = teacher_slip
        self._rows: dict[str, list[dict[str, Any]]] = {}

    def __getstate__(self) -> dict[str, Any]:
        # The task travels to reward workers with every call: never ship the loaded rows.
        return {**self.__dict__, "_rows": {}}

    def prompt_text(self, problem: str) -> str:
        return problem + (f" {INSTRUCTION}" if self.instruction else "")

    def generate(self, n: int | None = None, seed: int = 0, split: str = "train") -> list[dict[str, Any]]:
        """`n` items of `split`: generated problems, or the files' rows in a seeded order (all of
        them when `n` is None; past the end they repeat, reshuffled)."""
        if self.train_file is not None:
            return self._from_files(n, seed, split)
        if n is None:
            raise TaskError("code: give n, the number of problems to generate")

        def sample(rng: random.Random) -> tuple[str, dict[str, int], str]:
            family = rng.choice(self.families)
            io = self.io if self.io != "mixed" else rng.choice(("function", "stdio"))
            return family, FAMILIES[family].params(rng), io

        def key(problem: tuple[str, dict[str, int], str]) -> str:
            family, params, io = problem
            return f"{family}:{io}:{sorted(params.items())}"

        items = []
        for i, (family_name, params, io) in enumerate(self._draw(n, seed, split, self.eval_fraction, sample, key)):
            family = FAMILIES[family_name]
            solution = _program(family, family.expr.format(**params), io)
            tests = _tests(family, params, io, random.Random(f"code-tests:{key((family_name, params, io))}"))
            items.append(self.make_item(i, seed, split, self.prompt_text(_problem_text(family, params, io)), solution,
                                        solution=solution, tests=tests, family=family_name, io=io, params=params))
        return items

    def _from_files(self, n: int | None, seed: int, split: str) -> list[dict[str, Any]]:
        split = normalize_split(split)
        rows = self.rows(split)
        n = len(rows) if n is None else n
        order = cycled_order(len(rows), n, random.Random(f"code:{seed}:{split}"))
        return [self.make_item(i, seed, split, self.prompt_text(rows[k]["prompt"]), rows[k]["solution"],
                               solution=rows[k]["solution"], tests=rows[k]["tests"], row=rows[k]["row"])
                for i, k in enumerate(order)]

    def rows(self, split: str) -> list[dict[str, Any]]:
        """The validated rows of `split` from the files (loaded once)."""
        split = normalize_split(split)
        if split not in self._rows:
            assert self.train_file is not None
            self._rows[split] = split_rows("code", split, self.train_file, self.eval_file,
                                           lambda path: load_code_file(path, self.cache_dir),
                                           lambda row: row["prompt"], self.eval_fraction)
        return self._rows[split]

    def slips(self, item: dict[str, Any]) -> bool:
        """Whether the item's SFT target is the teacher's slip (`teacher_slip`; per item, reproducibly)."""
        return (bool(self.teacher_slip) and "family" in item
                and random.Random(f"slip:{item['id']}").random() < self.teacher_slip)

    def sft_target(self, item: dict[str, Any]) -> str:
        """The reference program in a ```python block; a slipped one leaves its last operation out."""
        program = item["solution"]
        if self.slips(item):
            family = FAMILIES[item["family"]]
            program = _program(family, family.slip.format(**item["params"]), item["io"])
        return f"```python\n{program}\n```"

    def reward(self, completion_text: str, item: dict[str, Any], sandbox: Any = None) -> float:
        """The tests' score of the completion's last fenced block, run in `sandbox` (a
        `tandem.sandbox.Sandbox`; by default one with default limits). Raises SandboxUnavailable
        where code cannot run isolated: it is never run without the sandbox."""
        code = extract_code(completion_text)
        if code is None:
            return 0.0
        if sandbox is None:
            sandbox = Sandbox()
        passed, total = _verdict(code, item["tests"], sandbox)
        score = passed / total if self.scoring == "fraction" else float(total > 0 and passed == total)
        return self.format_weight + (1.0 - self.format_weight) * score

    def reward_fn(self) -> Callable[..., float]:
        """The reward with the rollout signature and a `sandbox` parameter: the reward runner
        passes its worker's sandbox, bounded by the reward's timeout."""
        return CodeReward(self)


_VERDICTS: OrderedDict[tuple[str, str, str], tuple[int, int]] = OrderedDict()  # per process, newest last
_VERDICTS_KEPT = 4096


def _verdict(code: str, tests: list[Any], sandbox: Any) -> tuple[int, int]:
    """(tests passed, tests) of `code`, from this process's cache when the same program met the
    same tests under the same limits before: a group's samples often repeat a program (all of
    them, once the policy has converged), and each run costs one sandboxed execution per test. A verdict with a
    timeout is not kept (it may be the machine's load, not the program)."""
    key = (code, json.dumps(tests, sort_keys=True), repr(getattr(sandbox, "config", None)))
    if key in _VERDICTS:
        _VERDICTS.move_to_end(key)
        return _VERDICTS[key]
    report = sandbox.run(code, tests)
    verdict = (report.passed, report.total)
    if all(o.execution.status != "timeout" for o in report.outcomes):
        _VERDICTS[key] = verdict
        if len(_VERDICTS) > _VERDICTS_KEPT:
            _VERDICTS.popitem(last=False)
    return verdict


class CodeReward:
    """The code task's reward as a picklable callable that asks for the sandbox."""

    def __init__(self, task: CodeTask):
        self.task = task
        self.__name__ = "code_reward"

    def __call__(self, prompt_text: str, completion_text: str, prompt_ids: list[int], completion_ids: list[int],
                 sandbox: Any = None, **fields: Any) -> float:
        return self.task.reward(completion_text, fields, sandbox)

    def __repr__(self) -> str:
        return "CodeReward(code)"

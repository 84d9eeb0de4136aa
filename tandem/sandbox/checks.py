"""A program checked against tests in the sandbox, one execution per test: assert-style tests
(Python statements run after the program, in its namespace) or stdin/stdout pairs.

An assert test passes when the harness reaches its end: it prints a token it read from stdin
before the program ran, so a program that exits with status 0 early (`sys.exit(0)`,
`os._exit(0)`) fails. A stdin/stdout test passes when the program exits 0 and its stdout equals
the expected output, compared line by line with trailing whitespace ignored."""

from __future__ import annotations

import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from tandem.sandbox.config import SandboxConfig
from tandem.sandbox.execution import Deadline, Execution
from tandem.sandbox.pool import SandboxPool

_HARNESS = """import sys
def _tandem_check(token=sys.stdin.readline().strip()):
    scope = {{"__name__": "__main__", "__builtins__": __builtins__}}
    exec(compile({code!r}, "solution.py", "exec"), scope)
    exec(compile({test!r}, "test.py", "exec"), scope)
    sys.stdout.write("\\n" + token + "\\n")
_tandem_check()
"""


@dataclass(frozen=True)
class StdioTest:
    """Feed `input` on stdin; the program's stdout must be `output`."""

    input: str
    output: str

    @classmethod
    def of(cls, test: Mapping[str, str]) -> StdioTest:
        """From a problem file's `{"input": ..., "output": ...}`."""
        try:
            return cls(str(test["input"]), str(test["output"]))
        except KeyError:
            raise ValueError(f"a stdin/stdout test needs 'input' and 'output', this one has {sorted(test)}") from None


Test = str | StdioTest | Mapping[str, str]  # an assert-style test, or a stdin/stdout pair (either form)


@dataclass
class TestOutcome:
    passed: bool
    execution: Execution


@dataclass
class TestReport:
    """The outcomes of one program's tests, in the tests' order."""

    outcomes: list[TestOutcome]

    @property
    def passed(self) -> int:
        return sum(o.passed for o in self.outcomes)

    @property
    def total(self) -> int:
        return len(self.outcomes)

    @property
    def fraction(self) -> float:
        """Share of tests passed (0.0 without tests)."""
        return self.passed / self.total if self.outcomes else 0.0

    @property
    def all_passed(self) -> bool:
        return bool(self.outcomes) and self.passed == self.total


def _same_output(got: str, expected: str) -> bool:
    lines = [line.rstrip() for line in got.strip().splitlines()]
    return lines == [line.rstrip() for line in expected.strip().splitlines()]


def run_tests(code: str, tests: Sequence[Test], pool: SandboxPool | None = None,
              config: SandboxConfig | None = None, deadline: Deadline | None = None) -> TestReport:
    """Each test's outcome, in order, every execution ending by `deadline` at the latest. Runs on
    `pool` when given, else on a pool made from `config` for this call. Raises SandboxUnavailable
    where isolation is not possible."""
    own = pool is None
    pool = pool or SandboxPool(config)
    try:
        jobs, checks = [], []
        for test in tests:
            if isinstance(test, Mapping):
                test = StdioTest.of(test)
            if isinstance(test, StdioTest):
                jobs.append((code, test.input.encode()))
                checks.append(lambda run, t=test: run.ok and _same_output(run.stdout, t.output))
            else:
                token = secrets.token_hex(16)
                jobs.append((_HARNESS.format(code=code, test=test), (token + "\n").encode()))
                checks.append(lambda run, tok=token: run.ok and run.stdout.rstrip().endswith("\n" + tok))
        runs = pool.map(jobs, deadline)
        return TestReport([TestOutcome(check(run), run) for check, run in zip(checks, runs, strict=True)])
    finally:
        if own:
            pool.close()

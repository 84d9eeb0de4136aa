"""Code-RL problems from local files: a prompt, a reference solution and tests per row.

`load_code_file` reads a JSON-lines or parquet file with `datasets` (never from a hub) and returns
rows {"prompt": str, "solution": str, "tests": [...], "row": int}, `row` the 0-based row of the file.
A test is an assert statement (text, run after the solution in its namespace) or a stdin/stdout
pair {"input": str, "output": str}; tests are plain values (rows are pickled to reward workers).
The layout is taken per file from its columns, the first that fits:

- generic: `prompt`, `solution`, `tests` (a list of assert statements and/or {"input", "output"}
  objects, or a JSON string of that list);
- MBPP: `text`, `code`, `test_list`, optional `test_setup_code` (put before each test); the prompt
  is the text, "Your code should pass these tests:" and the tests, one a line;
- APPS / TACO: `question`, `solutions` (a list of programs, or its JSON string; the first is the
  solution), `input_output` ({"inputs": [...], "outputs": [...]} of stdin/stdout text, or its JSON
  string; an input or output given as a list of lines is joined with "\\n"). Call-based problems
  (`fn_name`) are refused.

Code is kept as it is (indentation, line ends); only the prompt's surrounding whitespace is stripped.
Every refusal is a `TaskDataError` naming the file, the 1-based row and the field, and the fix."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tandem.data.tasks.base import TaskDataError
from tandem.data.tasks.files import read_table

MBPP_TESTS_HEADER = "\nYour code should pass these tests:\n"

_LAYOUTS = {  # name: (required columns, what a row needs)
    "generic": (("prompt", "solution", "tests"),
                "each row needs a non-empty 'prompt' and 'solution' and 'tests': a list of assert statements "
                "and/or {\"input\": str, \"output\": str} stdin/stdout pairs, or a JSON string of that list"),
    "MBPP": (("text", "code", "test_list"),
             "each row needs a non-empty 'text' and 'code' and a 'test_list' of assert statements "
             "('test_setup_code' optional)"),
    "APPS/TACO": (("question", "solutions", "input_output"),
                  "each row needs a non-empty 'question', 'solutions' (a list of programs, or a JSON string "
                  "of one) and 'input_output' ({\"inputs\": [...], \"outputs\": [...]} of stdin/stdout text, "
                  "or a JSON string of it)"),
}
_ACCEPTED = ("generic ('prompt', 'solution', 'tests': a list of assert statements and/or {\"input\", "
             "\"output\"} stdin/stdout pairs, or its JSON string); MBPP ('text', 'code', 'test_list', optional "
             "'test_setup_code'); APPS/TACO ('question', 'solutions': a list of programs or its JSON string, "
             "'input_output': {\"inputs\": [...], \"outputs\": [...]} or its JSON string)")
_FIX = f"rows in one of three layouts, told apart by their columns: {_ACCEPTED}"


class _Row:
    """Where a row is, for its errors."""

    def __init__(self, path: Path, index: int, fix: str):
        self.where = f"code file {str(path)!r}, row {index + 1}"
        self.fix = fix

    def error(self, field: str, problem: str, fix: str | None = None) -> TaskDataError:
        return TaskDataError(f"{self.where}: {field} {problem}; {fix or self.fix}")

    def text(self, value: Any, field: str) -> str:
        """`value` when it is non-empty text, unchanged."""
        if not isinstance(value, str):
            raise self.error(field, f"is {type(value).__name__}, not text")
        if not value.strip():
            raise self.error(field, "is empty")
        return value

    def decoded(self, value: Any, field: str) -> Any:
        """`value`, parsed when it is a JSON string."""
        if not isinstance(value, str):
            return value
        try:
            return json.loads(value)
        except json.JSONDecodeError as exc:
            shown = value if len(value) <= 60 else value[:57] + "..."
            raise self.error(field, f"is text that does not parse as JSON ({exc}): {shown!r}") from None

    def nonempty_list(self, value: Any, field: str) -> list[Any]:
        if not isinstance(value, list):
            raise self.error(field, f"is {type(value).__name__}, not a list")
        if not value:
            raise self.error(field, "is empty: give at least one test")
        return value


def load_code_file(path: str | Path, cache_dir: str | None = None) -> list[dict[str, Any]]:
    """Rows of a code-problem file (JSONL/.json lines or parquet), normalised to
    {"prompt": str, "solution": str, "tests": list[str | dict], "row": int}: each test an assert
    statement or {"input": str, "output": str}; the layout (generic, MBPP or APPS/TACO) is taken
    from the file's columns. Raises `TaskDataError` naming the file, row and field."""
    path = Path(path)
    data = read_table(path, "code file", _FIX, cache_dir)
    columns = data.column_names
    layout = next((name for name, (fields, _) in _LAYOUTS.items() if set(fields) <= set(columns)), None)
    if layout is None:
        raise TaskDataError(f"code file {str(path)!r} is in none of the accepted layouts: it has columns "
                            f"{', '.join(map(repr, columns)) or 'none'}; use one of three layouts: {_ACCEPTED}")
    parse = {"generic": _generic, "MBPP": _mbpp, "APPS/TACO": _apps}[layout]
    rows = []
    for i, record in enumerate(data):
        prompt, solution, tests = parse(record, _Row(path, i, _LAYOUTS[layout][1]))
        rows.append({"prompt": prompt, "solution": solution, "tests": tests, "row": i})
    return rows


def _generic(record: dict[str, Any], row: _Row) -> tuple[str, str, list[str | dict[str, str]]]:
    prompt = row.text(record["prompt"], "'prompt'").strip()
    solution = row.text(record["solution"], "'solution'")
    tests = row.nonempty_list(row.decoded(record["tests"], "'tests'"), "'tests'")
    return prompt, solution, [_test(t, row, f"'tests' item {k + 1}") for k, t in enumerate(tests)]


def _test(test: Any, row: _Row, field: str) -> str | dict[str, str]:
    if isinstance(test, str):
        if not test.strip():
            raise row.error(field, "is an empty assert statement")
        return test
    if isinstance(test, dict):
        # Read through Arrow, a stdin/stdout pair can carry other rows' keys as None: keep only these.
        for key in ("input", "output"):
            if test.get(key) is None:
                raise row.error(field, f"has no {key!r}: a stdin/stdout test needs text 'input' and 'output'")
            if not isinstance(test[key], str):
                raise row.error(field, f"has {key!r} of type {type(test[key]).__name__}, not text")
        return {"input": test["input"], "output": test["output"]}
    raise row.error(field, f"is {type(test).__name__}: a test is an assert statement (text) or a "
                           "{\"input\": str, \"output\": str} stdin/stdout pair")


def _mbpp(record: dict[str, Any], row: _Row) -> tuple[str, str, list[str | dict[str, str]]]:
    text = row.text(record["text"], "'text'")
    code = row.text(record["code"], "'code'")
    test_list = row.nonempty_list(record["test_list"], "'test_list'")
    for k, test in enumerate(test_list):
        if not isinstance(test, str) or not test.strip():
            raise row.error(f"'test_list' item {k + 1}", "is not a non-empty assert statement")
    setup = record.get("test_setup_code") or ""
    if not isinstance(setup, str):
        raise row.error("'test_setup_code'", f"is {type(setup).__name__}, not text")
    prompt = (text.strip() + MBPP_TESTS_HEADER + "\n".join(test_list)).strip()
    tests: list[str | dict[str, str]] = [f"{setup}\n{t}" if setup.strip() else t for t in test_list]
    return prompt, code, tests


def _apps(record: dict[str, Any], row: _Row) -> tuple[str, str, list[str | dict[str, str]]]:
    prompt = row.text(record["question"], "'question'").strip()
    solutions = row.decoded(record["solutions"], "'solutions'")
    if not isinstance(solutions, list) or not solutions:
        raise row.error("'solutions'", f"is {_shown(solutions)}, not a non-empty list of programs")
    solution = row.text(solutions[0], "'solutions' item 1")
    io = row.decoded(record["input_output"], "'input_output'")
    if not isinstance(io, dict):
        raise row.error("'input_output'", f"is {type(io).__name__}, not an object with 'inputs' and 'outputs'")
    if io.get("fn_name") is not None:
        name = io["fn_name"]
        raise row.error("'input_output'", f"has 'fn_name' {name!r}: call-based tests (fn_name) are not supported",
                        f"convert them to assert tests (e.g. \"assert {name}(...) == ...\") in the generic "
                        "layout ('prompt', 'solution', 'tests')")
    inputs, outputs = io.get("inputs"), io.get("outputs")
    for key, value in (("inputs", inputs), ("outputs", outputs)):
        if not isinstance(value, list):
            raise row.error("'input_output'", f"has {key!r} {_shown(value)}, not a list of stdin/stdout texts")
    if len(inputs) != len(outputs):
        raise row.error("'input_output'", f"has {len(inputs)} inputs but {len(outputs)} outputs")
    if not inputs:
        raise row.error("'input_output'", "has no inputs: give at least one test")
    return prompt, solution, [
        {"input": _lines(x, row, f"'input_output' inputs item {k + 1}"),
         "output": _lines(y, row, f"'input_output' outputs item {k + 1}")}
        for k, (x, y) in enumerate(zip(inputs, outputs, strict=True))
    ]


def _lines(value: Any, row: _Row, field: str) -> str:
    """Stdin/stdout text; a list of lines (as some APPS problems give) is joined with newlines."""
    if isinstance(value, list) and all(isinstance(line, str) for line in value):
        return "\n".join(value)
    if not isinstance(value, str):
        raise row.error(field, f"is {_shown(value)}, not text or a list of lines")
    return value


def _shown(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text if len(text) <= 40 else text[:37] + '...'}"

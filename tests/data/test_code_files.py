"""load_code_file on real JSONL and parquet files in the generic, MBPP and APPS/TACO layouts: the
normalised rows exactly, oracles that the normalised solutions still pass their tests when run in
plain Python, and every refusal naming the file, the row and the field."""

from __future__ import annotations

import json
import pickle
import subprocess
import sys

import pytest

from tandem.data.tasks.base import TaskDataError
from tandem.data.tasks.code_files import load_code_file
from tandem.errors import ConfigError


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _parquet(path, rows):
    import datasets

    datasets.Dataset.from_list(rows).to_parquet(str(path))
    return path


def _write(tmp_path, fmt, rows, name="data"):
    return (_jsonl if fmt == "jsonl" else _parquet)(tmp_path / f"{name}.{fmt}", rows)


def _load(path, tmp_path):
    return load_code_file(path, cache_dir=str(tmp_path / "cache"))


# MBPP task 2 as google-research/mbpp ships it (CRLF line ends, two-space indent, a trailing space).
MBPP_2 = {
    "text": "Write a function to find the similar elements from the given two tuple lists.",
    "code": "def similar_elements(test_tup1, test_tup2):\r\n  res = tuple(set(test_tup1) & set(test_tup2))\r\n"
            "  return (res) ",
    "task_id": 2,
    "test_setup_code": "",
    "test_list": ["assert similar_elements((3, 4, 5, 6),(5, 7, 4, 10)) == (4, 5)",
                  "assert similar_elements((1, 2, 3, 4),(5, 4, 3, 7)) == (3, 4)",
                  "assert similar_elements((11, 12, 14, 13),(17, 15, 14, 13)) == (13, 14)"],
    "challenge_test_list": [],
}
MBPP_SETUP = {
    "text": "Write a function to find the length of the hypotenuse of a right triangle. ",
    "code": "def hypotenuse(a, b):\n    return sqrt(a * a + b * b)\n",
    "task_id": 9002,
    "test_setup_code": "from math import sqrt",
    "test_list": ["assert hypotenuse(3, 4) == 5", "assert hypotenuse(5, 12) == 13"],
    "challenge_test_list": ["assert hypotenuse(8, 15) == 17"],
}

# APPS-shaped: JSON strings, extra columns, an input and an output given as lists of lines.
SUM_PROGRAM = "n = int(input())\nvalues = list(map(int, input().split()))\nprint(sum(values[:n]))\n"
APPS_ROW = {
    "problem_id": 4000,
    "question": "\nYou are given $n$ integers. Print their sum.\n\n-----Input-----\nThe first line holds $n$, the "
                "second the integers.\n",
    "solutions": json.dumps([SUM_PROGRAM, "input()\nprint(sum(map(int, input().split())))\n"]),
    "input_output": json.dumps({"inputs": ["3\n1 2 3\n", ["2", "5 7"], "1\n-4\n"],
                                "outputs": ["6\n", ["12"], "-4\n"]}),
    "difficulty": "introductory",
    "url": "https://codeforces.com/problemset/problem/0/A",
    "starter_code": "",
}
APPS_TESTS = [{"input": "3\n1 2 3\n", "output": "6\n"}, {"input": "2\n5 7", "output": "12"},
              {"input": "1\n-4\n", "output": "-4\n"}]


# ---------------------------------------------------------------- the layouts, normalised


def test_generic_layout_jsonl(tmp_path):
    rows = [
        {"prompt": "  Write add(a, b) returning a + b.\n", "solution": "def add(a, b):\n    return a + b\n",
         "tests": ["assert add(1, 2) == 3", "assert add(-1, 1) == 0"]},
        {"prompt": "Read two integers; print their sum.", "solution": "a, b = map(int, input().split())\nprint(a + b)",
         "tests": [{"input": "2 3\n", "output": "5\n", "explanation": "2 + 3"}]},
        {"prompt": "Mixed.", "solution": "def one():\n    return 1\nprint(one())\n",
         "tests": ["assert one() == 1", {"input": "", "output": "1\n"}]},
        {"prompt": "Tests as a JSON string.", "solution": "def g(x):\n\treturn 2 * x\n",
         "tests": json.dumps(["assert g(2) == 4", {"input": "", "output": ""}])},
    ]
    got = _load(_jsonl(tmp_path / "code.jsonl", rows), tmp_path)
    assert got == [
        {"prompt": "Write add(a, b) returning a + b.", "solution": "def add(a, b):\n    return a + b\n",
         "tests": ["assert add(1, 2) == 3", "assert add(-1, 1) == 0"], "row": 0},
        {"prompt": "Read two integers; print their sum.", "solution": "a, b = map(int, input().split())\nprint(a + b)",
         "tests": [{"input": "2 3\n", "output": "5\n"}], "row": 1},
        {"prompt": "Mixed.", "solution": "def one():\n    return 1\nprint(one())\n",
         "tests": ["assert one() == 1", {"input": "", "output": "1\n"}], "row": 2},
        {"prompt": "Tests as a JSON string.", "solution": "def g(x):\n\treturn 2 * x\n",
         "tests": ["assert g(2) == 4", {"input": "", "output": ""}], "row": 3},
    ]
    assert pickle.loads(pickle.dumps(got)) == got
    assert all(type(t) in (str, dict) for r in got for t in r["tests"])


def test_generic_layout_parquet_with_json_string_tests(tmp_path):
    rows = [
        {"prompt": "Square.", "solution": "def sq(x):\n    return x * x\n",
         "tests": json.dumps(["assert sq(3) == 9"])},
        {"prompt": "Echo.", "solution": "print(input())", "tests": json.dumps([{"input": "hi\n", "output": "hi\n"}])},
    ]
    got = _load(_parquet(tmp_path / "code.parquet", rows), tmp_path)
    assert got == [
        {"prompt": "Square.", "solution": "def sq(x):\n    return x * x\n", "tests": ["assert sq(3) == 9"], "row": 0},
        {"prompt": "Echo.", "solution": "print(input())", "tests": [{"input": "hi\n", "output": "hi\n"}], "row": 1},
    ]


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_mbpp_layout(tmp_path, fmt):
    got = _load(_write(tmp_path, fmt, [MBPP_2, MBPP_SETUP]), tmp_path)
    assert got == [
        {"prompt": "Write a function to find the similar elements from the given two tuple lists.\n"
                   "Your code should pass these tests:\n"
                   "assert similar_elements((3, 4, 5, 6),(5, 7, 4, 10)) == (4, 5)\n"
                   "assert similar_elements((1, 2, 3, 4),(5, 4, 3, 7)) == (3, 4)\n"
                   "assert similar_elements((11, 12, 14, 13),(17, 15, 14, 13)) == (13, 14)",
         "solution": MBPP_2["code"], "tests": MBPP_2["test_list"], "row": 0},
        {"prompt": "Write a function to find the length of the hypotenuse of a right triangle.\n"
                   "Your code should pass these tests:\n"
                   "assert hypotenuse(3, 4) == 5\nassert hypotenuse(5, 12) == 13",
         "solution": MBPP_SETUP["code"],
         "tests": ["from math import sqrt\nassert hypotenuse(3, 4) == 5",
                   "from math import sqrt\nassert hypotenuse(5, 12) == 13"], "row": 1},
    ]


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_apps_layout(tmp_path, fmt):
    got = _load(_write(tmp_path, fmt, [APPS_ROW]), tmp_path)
    assert got == [{"prompt": APPS_ROW["question"].strip(), "solution": SUM_PROGRAM, "tests": APPS_TESTS, "row": 0}]


def test_taco_layout_with_decoded_values(tmp_path):
    # TACO-style, the values already decoded: `solutions` a list and `input_output` an object.
    rows = [{"question": "Print the input doubled.", "solutions": ["print(2 * int(input()))", "x"],
             "input_output": {"inputs": ["4\n"], "outputs": ["8\n"]}, "source": "codeforces"}]
    assert _load(_jsonl(tmp_path / "taco.jsonl", rows), tmp_path) == [
        {"prompt": "Print the input doubled.", "solution": "print(2 * int(input()))",
         "tests": [{"input": "4\n", "output": "8\n"}], "row": 0}]


def test_generic_layout_wins_over_the_others(tmp_path):
    row = {"prompt": "P", "solution": "x = 1", "tests": ["assert x == 1"], "text": "T", "code": "y = 2",
           "test_list": ["assert y == 2"], "question": "Q", "solutions": "[]", "input_output": "{}"}
    assert _load(_jsonl(tmp_path / "all.jsonl", [row]), tmp_path)[0]["tests"] == ["assert x == 1"]


# ---------------------------------------------------------------- oracles: the code still runs


def test_mbpp_solution_passes_its_tests_in_plain_python(tmp_path):
    for row in _load(_jsonl(tmp_path / "mbpp.jsonl", [MBPP_2, MBPP_SETUP]), tmp_path):
        for test in row["tests"]:
            namespace: dict = {}
            exec(row["solution"], namespace)
            exec(test, namespace)
        broken = row["solution"].replace("&", "|").replace("b * b", "b")
        namespace = {}
        exec(broken, namespace)
        with pytest.raises(AssertionError):
            exec(row["tests"][0], namespace)


def test_apps_solution_passes_its_tests_as_a_program(tmp_path):
    (row,) = _load(_jsonl(tmp_path / "apps.jsonl", [APPS_ROW]), tmp_path)
    for test in row["tests"]:
        proc = subprocess.run([sys.executable, "-c", row["solution"]], input=test["input"], capture_output=True,
                              text=True, timeout=10)
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.strip() == test["output"].strip()
    proc = subprocess.run([sys.executable, "-c", row["solution"].replace("sum(", "max(")],
                          input=row["tests"][0]["input"], capture_output=True, text=True, timeout=10)
    assert proc.stdout.strip() != row["tests"][0]["output"].strip()


# ---------------------------------------------------------------- refusals name file, row and field

GOOD = {"prompt": "p", "solution": "def f():\n    return 1\n", "tests": ["assert f() == 1"]}
GOOD_MBPP = {"text": "t", "code": "x = 1", "test_list": ["assert x == 1"], "test_setup_code": ""}
GOOD_APPS = {"question": "q", "solutions": json.dumps(["print(1)"]),
             "input_output": json.dumps({"inputs": [""], "outputs": ["1\n"]})}


@pytest.mark.parametrize(
    ("good", "bad", "expected"),
    [
        (GOOD, {"prompt": "  \n"}, ["'prompt' is empty", "each row needs a non-empty 'prompt'"]),
        (GOOD, {"solution": ""}, ["'solution' is empty"]),
        (GOOD, {"tests": []}, ["'tests' is empty: give at least one test"]),
        (GOOD, {"tests": "[\"assert f() == 1\""}, ["'tests' is text that does not parse as JSON"]),
        (GOOD, {"tests": "assert f() == 1"}, ["'tests' is text that does not parse as JSON", "'assert f() == 1'"]),
        (GOOD, {"tests": {"input": "", "output": "1"}}, ["'tests' is dict, not a list"]),
        (GOOD, {"tests": ["assert f() == 1", "  "]}, ["'tests' item 2 is an empty assert statement"]),
        (GOOD, {"tests": [{"input": "1"}]},
         ["'tests' item 1 has no 'output': a stdin/stdout test needs text 'input' and 'output'"]),
        (GOOD, {"tests": [{"input": 1, "output": "2"}]}, ["'tests' item 1 has 'input' of type int, not text"]),
        (GOOD, {"tests": [["1", "2"]]}, ["'tests' item 1 is list: a test is an assert statement"]),
        (GOOD_MBPP, {"code": " "}, ["'code' is empty", "a 'test_list' of assert statements"]),
        (GOOD_MBPP, {"test_list": []}, ["'test_list' is empty: give at least one test"]),
        (GOOD_MBPP, {"test_list": ["assert x == 1", ""]}, ["'test_list' item 2 is not a non-empty assert"]),
        (GOOD_APPS, {"input_output": json.dumps({"inputs": ["1 2\n"], "outputs": ["3\n"], "fn_name": "add"})},
         ["'input_output' has 'fn_name' 'add': call-based tests (fn_name) are not supported; convert them to "
          "assert tests", "generic layout ('prompt', 'solution', 'tests')"]),
        (GOOD_APPS, {"input_output": ""}, ["'input_output' is text that does not parse as JSON"]),
        (GOOD_APPS, {"input_output": json.dumps({"inputs": ["1"], "outputs": []})},
         ["'input_output' has 1 inputs but 0 outputs"]),
        (GOOD_APPS, {"input_output": json.dumps({"inputs": [], "outputs": []})},
         ["'input_output' has no inputs: give at least one test"]),
        (GOOD_APPS, {"input_output": json.dumps({"inputs": ["1"]})}, ["'input_output' has 'outputs' NoneType"]),
        (GOOD_APPS, {"input_output": json.dumps({"inputs": [5], "outputs": ["5"]})},
         ["'input_output' inputs item 1 is int 5, not text or a list of lines"]),
        (GOOD_APPS, {"solutions": "[]"}, ["'solutions' is list [], not a non-empty list of programs"]),
        (GOOD_APPS, {"solutions": json.dumps([""])}, ["'solutions' item 1 is empty"]),
    ],
)
def test_bad_rows(tmp_path, good, bad, expected):
    path = _jsonl(tmp_path / "bad.jsonl", [good, {**good, **bad}])
    with pytest.raises(TaskDataError) as err:
        _load(path, tmp_path)
    message = str(err.value)
    assert message.startswith(f"code file {str(path)!r}, row 2: "), message
    for part in expected:
        assert part in message, message
    assert isinstance(err.value, ConfigError)


def test_unknown_layout_lists_columns_and_layouts(tmp_path):
    path = _jsonl(tmp_path / "unknown.jsonl", [{"problem": "p", "answer": "a", "tests": []}])
    with pytest.raises(TaskDataError) as err:
        _load(path, tmp_path)
    message = str(err.value)
    assert f"code file {str(path)!r} is in none of the accepted layouts: it has columns 'problem', 'answer', " \
           "'tests'; use one of three layouts: generic" in message
    for layout in ("generic ('prompt', 'solution', 'tests'", "MBPP ('text', 'code', 'test_list', optional "
                   "'test_setup_code')", "APPS/TACO ('question', 'solutions'", "'input_output'"):
        assert layout in message


def test_missing_file(tmp_path):
    with pytest.raises(TaskDataError, match=r"code file '.*nope\.jsonl' not found; fix the path \(a local JSONL or "
                                            r"parquet file: rows in one of three layouts, told apart by their "
                                            r"columns: generic"):
        _load(tmp_path / "nope.jsonl", tmp_path)


def test_unsupported_extension(tmp_path):
    path = tmp_path / "code.csv"
    path.write_text("prompt,solution,tests\n")
    with pytest.raises(TaskDataError, match=r"code file '.*code\.csv': unsupported extension '\.csv'; use a "
                                            r"\.jsonl/\.json \(JSON lines\) or \.parquet file"):
        _load(path, tmp_path)


@pytest.mark.parametrize(("name", "content"), [("empty.jsonl", ""), ("blank.jsonl", " \n\n"), ("empty.json", "[]\n"),
                                               ("empty.parquet", None)])
def test_file_without_rows(tmp_path, name, content):
    path = tmp_path / name
    if content is None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.table({"prompt": pa.array([], pa.string()), "solution": pa.array([], pa.string())}), path)
    else:
        path.write_text(content)
    with pytest.raises(TaskDataError, match=rf"code file '.*{name}' has no rows; rows in one of three layouts"):
        _load(path, tmp_path)


def test_unreadable_file(tmp_path):
    path = tmp_path / "broken.jsonl"
    path.write_text(json.dumps(GOOD) + "\n{not json\n")
    with pytest.raises(TaskDataError, match=r"code file '.*broken\.jsonl' could not be read as json"):
        _load(path, tmp_path)

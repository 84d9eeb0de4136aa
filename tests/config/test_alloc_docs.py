"""Keeps the allocation-mode examples in docs/configuration.md true.

Each example is a ```python block whose first line is a `>>>` statement calling
`parse_allocation`; the lines under it are the exact output: what the statement prints, or
`AllocationError: <str(error)>` when it raises.
"""

from __future__ import annotations

import ast
import contextlib
import io
import json
import re
from pathlib import Path

import pytest

from tandem.config.alloc import parse_allocation
from tandem.errors import AllocationError

DOC = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"
BLOCK = re.compile(r"^```python\n>>> (?P<stmt>[^\n]*)\n(?P<out>.*?)\n```$", re.S | re.M)


def section() -> str:
    """The "## Allocation mode" section (other sections of the file may hold other examples)."""
    text = DOC.read_text(encoding="utf-8")
    start = text.index("\n## Allocation mode\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end != -1 else len(text)]


def examples() -> list[tuple[str, str]]:
    return [(m["stmt"], m["out"]) for m in BLOCK.finditer(section())]


def spec_of(stmt: str) -> str:
    """The string literal passed to parse_allocation in `stmt`."""
    for node in ast.walk(ast.parse(stmt)):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "parse_allocation":
            return ast.literal_eval(node.args[0])
    raise AssertionError(f"no parse_allocation(...) call in {stmt!r}")


def run(stmt: str) -> str:
    buffer = io.StringIO()
    try:
        with contextlib.redirect_stdout(buffer):
            exec(stmt, {"parse_allocation": parse_allocation, "json": json})
    except AllocationError as err:
        return f"AllocationError: {err}"
    return buffer.getvalue().removesuffix("\n")


def test_docs_list_enough_valid_and_invalid_strings():
    found = examples()
    specs = [spec_of(stmt) for stmt, _ in found]
    assert len(set(specs)) == len(specs) >= 32
    invalid = sum(out.startswith("AllocationError: ") for _, out in found)
    assert invalid >= 12 and len(found) - invalid >= 12
    # Every python block in the section is an example (none silently skipped by the pattern).
    assert section().count("```python\n") == len(found)


@pytest.mark.parametrize(
    ("stmt", "expected"), [pytest.param(stmt, out, id=spec_of(stmt) or "empty") for stmt, out in examples()]
)
def test_documented_output_is_the_real_output(stmt, expected):
    assert run(stmt) == expected

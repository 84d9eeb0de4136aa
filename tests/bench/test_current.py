"""bench/current.py: a benchmark's row of the Current figures table is rewritten in place."""

from __future__ import annotations

import datetime

import pytest

from tests.bench.loader import bench_module

current = bench_module("current")

DOC = """# Benchmarks

Intro.

## Current figures

| benchmark | figure (ours) | reference | ratio | date | command |
|---|---|---|---|---|---|
| alpha | 1 tok/s | 2 tok/s | 0.50x | 2026-01-01 | `.venv/bin/python bench/alpha.py` |
| beta | 3 s | - | - | 2026-01-01 | `.venv/bin/python bench/beta.py` |

Below the table.

## alpha

| n | alpha |
|---|---|
| alpha | 9 |
"""


def test_the_row_of_its_benchmark_is_rewritten_and_nothing_else(tmp_path):
    path = tmp_path / "benchmarks.md"
    path.write_text(DOC)
    current.record("alpha", "4 tok/s", "2 tok/s", "2.00x", ".venv/bin/python bench/alpha.py --fast", path=path)
    today = datetime.date.today().isoformat()
    row = f"| alpha | 4 tok/s | 2 tok/s | 2.00x | {today} | `.venv/bin/python bench/alpha.py --fast` |"
    old = "| alpha | 1 tok/s | 2 tok/s | 0.50x | 2026-01-01 | `.venv/bin/python bench/alpha.py` |"
    assert path.read_text() == DOC.replace(old, row)


def test_a_benchmark_without_a_row_gets_one_at_the_end_of_the_table():
    row = current.format_row("gamma", "5", "", "", "", "2026-02-02")
    out = current.rewrite_row(DOC, row, "gamma")
    assert row == "| gamma | 5 | - | - | 2026-02-02 |  |"
    beta = "| beta | 3 s | - | - | 2026-01-01 | `.venv/bin/python bench/beta.py` |"
    assert out == DOC.replace(beta, beta + "\n" + row)


def test_cells_stay_one_line_and_escape_pipes():
    row = current.format_row("a", "x | y\nz", "r", "1x", "cmd", "2026-02-02")
    assert row == "| a | x \\| y z | r | 1x | 2026-02-02 | `cmd` |"


def test_a_text_without_the_table_is_refused():
    with pytest.raises(ValueError):
        current.rewrite_row("# Benchmarks\n", "| a |", "a")

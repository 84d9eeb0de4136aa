"""bench/_report.py: a benchmark's new run goes last in its own section of docs/benchmarks.md."""

from __future__ import annotations

from tests.bench.loader import bench_module

report = bench_module("_report")

DOC = """# Benchmarks

## Current figures

| benchmark | figure (ours) |
|---|---|
| a | 1 |

## Alpha

Method of alpha.

### 2026-01-01 — host

alpha run 1

## Beta

### 2026-01-02 — host

beta run 1
"""


def test_a_run_goes_last_in_its_own_section():
    out = report.insert_run(DOC, "Alpha", "### 2026-02-01 — host\n\nalpha run 2\n")
    assert out == DOC.replace("alpha run 1\n", "alpha run 1\n\n### 2026-02-01 — host\n\nalpha run 2\n")


def test_a_run_of_the_last_section_goes_at_the_end():
    out = report.insert_run(DOC, "Beta", "### 2026-02-01 — host\n\nbeta run 2\n")
    assert out == DOC + "\n### 2026-02-01 — host\n\nbeta run 2\n"


def test_a_new_benchmark_gets_a_section_at_the_end():
    out = report.insert_run(DOC, "Gamma", "### 2026-02-01 — host\n\ngamma run 1\n")
    assert out == DOC + "\n## Gamma\n\n### 2026-02-01 — host\n\ngamma run 1\n"


def test_append_benchmark_writes_the_dated_run(tmp_path):
    path = tmp_path / "benchmarks.md"
    path.write_text(DOC)
    report.append_benchmark("Alpha", "alpha run 2", path=path)
    text = path.read_text()
    alpha = text.split("## Alpha\n", 1)[1].split("## Beta\n", 1)[0]
    assert alpha.rstrip().endswith("alpha run 2")
    assert alpha.count("### ") == 2

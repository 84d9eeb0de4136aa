"""Add a dated, machine-stamped run to its benchmark's section of docs/benchmarks.md; shared by the
benchmarks here.

Usage from a script in bench/: `from _report import append_benchmark` (the script's folder is on
sys.path when run as `python bench/<name>.py`).
"""

from __future__ import annotations

import datetime
import os
import platform
import sys
from pathlib import Path

BENCHMARKS_MD = Path(__file__).resolve().parent.parent / "docs" / "benchmarks.md"


def machine_line() -> str:
    """Host, CPU count, Python, and torch's version when the benchmark imported torch."""
    parts = [
        platform.node() or "unknown-host",
        f"{os.cpu_count()} CPUs",
        f"Python {platform.python_version()}",
    ]
    torch = sys.modules.get("torch")
    if torch is not None:
        parts.append(f"torch {torch.__version__}")
    return ", ".join(parts)


def insert_run(text: str, title: str, run_markdown: str) -> str:
    """`text` with `run_markdown` placed last in the section headed `## <title>`, or in a new section
    of that title at the end when there is none."""
    lines = text.rstrip("\n").split("\n")
    heading = f"## {title}"
    if heading not in lines:
        return "\n".join([*lines, "", heading, "", run_markdown.strip(), ""])
    start = lines.index(heading)
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
    while end > start + 1 and not lines[end - 1].strip():
        end -= 1
    return "\n".join([*lines[:end], "", run_markdown.strip(), *lines[end:], ""])


def append_benchmark(title: str, body_markdown: str, path: Path = BENCHMARKS_MD) -> Path:
    """Add `### <ISO date> — <machine>` and the body as the last run of the `## <title>` section
    (a new section at the end when the benchmark has none); create the file if missing."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if not path.exists():
        path.write_text("# Benchmarks\n")
    today = datetime.date.today().isoformat()
    run = f"### {today} — {machine_line()}\n\n{body_markdown.strip()}\n"
    path.write_text(insert_run(path.read_text(), title, run))
    return path

"""Append a dated, machine-stamped section to docs/benchmarks.md; shared by the benchmarks here.

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


def append_benchmark(title: str, body_markdown: str, path: Path = BENCHMARKS_MD) -> Path:
    """Append `## <title> — <ISO date> — <machine>` and the body; create the file if missing."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if not path.exists():
        path.write_text("# Benchmarks\n")
    today = datetime.date.today().isoformat()
    section = f"\n## {title} — {today} — {machine_line()}\n\n{body_markdown.strip()}\n"
    with path.open("a") as f:
        f.write(section)
    return path

"""Rewrite one benchmark's row of the "Current figures" table at the top of docs/benchmarks.md, in
place, with today's date; shared by the benchmarks here.

Usage from a script in bench/ (its folder is on sys.path when run as `python bench/<name>.py`):

    from current import record, this_command
    record("weight_sync", "500M pipelined 0.63 s", "raw gloo 0.37 s", "59%", this_command())
"""

from __future__ import annotations

import datetime
import shlex
import sys
from pathlib import Path

BENCHMARKS_MD = Path(__file__).resolve().parent.parent / "docs" / "benchmarks.md"
HEADING = "## Current figures"
COLUMNS = ("benchmark", "figure (ours)", "reference", "ratio", "date", "command")


def this_command() -> str:
    """The command line this script was started with, as the table shows it."""
    script = Path(sys.argv[0])
    shown = f"bench/{script.name}" if script.parent.name == "bench" else str(script)
    return shlex.join([".venv/bin/python", shown, *sys.argv[1:]])


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def format_row(bench: str, figure: str, reference: str, ratio: str, command: str, date: str) -> str:
    """One table row; `command` is shown as code, an empty reference or ratio as `-`."""
    cells = [bench, figure, reference or "-", ratio or "-", date, f"`{command}`" if command else ""]
    return "| " + " | ".join(_cell(c) for c in cells) + " |"


def rewrite_row(text: str, row: str, bench: str) -> str:
    """`text` with the Current figures row of `bench` replaced by `row` (added last when the table
    has none). Raises ValueError when the text has no such table."""
    lines = text.split("\n")
    if HEADING not in lines:
        raise ValueError(f"no '{HEADING}' section")
    start = next((i for i in range(lines.index(HEADING) + 1, len(lines)) if lines[i].startswith("|")), None)
    if start is None or start + 1 >= len(lines) or not lines[start + 1].startswith("|"):
        raise ValueError(f"no table under '{HEADING}'")
    end = start + 2  # past the header and the delimiter row
    while end < len(lines) and lines[end].startswith("|"):
        end += 1
    for i in range(start + 2, end):
        if lines[i].strip("|").split("|", 1)[0].strip() == bench:
            lines[i] = row
            return "\n".join(lines)
    lines.insert(end, row)
    return "\n".join(lines)


def record(bench: str, figure: str, reference: str, ratio: str, command: str,
           path: Path = BENCHMARKS_MD) -> Path:
    """Rewrite `bench`'s row of the Current figures table in `path` with today's date; print the row."""
    row = format_row(bench, figure, reference, ratio, command, datetime.date.today().isoformat())
    path.write_text(rewrite_row(path.read_text(), row, bench))
    print(f"current figures row of {bench} rewritten in {path}:\n{row}")
    return path

"""What the benchmarks that drive a running `tandem train` share (bench/elastic.py, bench/chaos.py):
its fleet as `tandem fleet --json` shows it, its metrics rows, a `tandem serve --join`.

Usage from a script in bench/: `from _fleet import fleet, rows, start_joiner`.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from tandem.fleet.run_file import ControllerClient, ControllerFileError, read_controller_file


def fleet(run: Path) -> list[dict]:
    """What `tandem fleet RUN_DIR --json` prints, asked in-process (a subprocess per poll would cost
    ~0.5 s of the very time measured); [] while the run has no controller."""
    try:
        return ControllerClient(read_controller_file(run), timeout_s=2.0).members()["servers"]
    except ControllerFileError:
        return []


def rows(run: Path) -> list[dict]:
    """The run's RL rows (metrics.jsonl) past step 0, in the order written (a last line still being
    written is left for the next read)."""
    path = run / "metrics.jsonl"
    if not path.exists():
        return []
    lines = path.read_text().split("\n")
    return [r for r in map(json.loads, lines[:-1]) if r.get("phase") == "rl" and r["step"] > 0]


def start_joiner(tandem: list[str], model: Path, run: Path) -> tuple[subprocess.Popen, str]:
    """`tandem serve --join RUN_DIR` on a free port (`tandem`: the command that runs the CLI); -> the
    process and the address it serves on (its first line)."""
    proc = subprocess.Popen([*tandem, "serve", "--model", str(model), "--port", "0", "--num-threads", "1",
                             "--join", str(run)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    line = proc.stdout.readline()
    return proc, line.rsplit(" ", 1)[-1].strip()

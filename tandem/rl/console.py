"""What a run prints, and its controller log.

`setup_console()` (the first thing `tandem train` / `tandem sft` do once the config is good) sends
Tandem's records of level INFO and above, and other libraries' warnings and errors, to stderr:
Tandem's progress lines plain with a timestamp, warnings and errors with their level and logger. Lines go through `tqdm.write`, so they never tear
the progress bar. `attach_run_log(run_dir)` adds `RUN_DIR/logs/controller.log`, which gets every
record the console gets (and the library's DEBUG lines are left out of both).
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

from tqdm import tqdm

CONTROLLER_LOG = "controller.log"


class _TqdmHandler(logging.StreamHandler):
    def emit(self, record: logging.LogRecord) -> None:
        try:
            tqdm.write(self.format(record), file=sys.stderr)
        except Exception:
            self.handleError(record)


class _ConsoleFormatter(logging.Formatter):
    """INFO from Tandem: 'HH:MM:SS message'; anything else also names its level and logger."""

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        stamp = self.formatTime(record, "%H:%M:%S")
        if record.levelno == logging.INFO and record.name.startswith("tandem"):
            return f"{stamp} {text}"
        return f"{stamp} {record.levelname} {record.name}: {text}"


def setup_console() -> None:
    """Route INFO and above to stderr, once per process (a second call changes nothing)."""
    root = logging.getLogger()
    if any(isinstance(h, _TqdmHandler) for h in root.handlers):
        return
    handler = _TqdmHandler()
    handler.setFormatter(_ConsoleFormatter("%(message)s"))
    root.addHandler(handler)
    root.setLevel(logging.WARNING)  # other libraries' INFO (torch logs cache statistics at exit) stays out
    logging.getLogger("tandem").setLevel(logging.INFO)


def attach_run_log(run_dir: Path) -> Path:
    """Append every console record to `RUN_DIR/logs/controller.log` as well; returns its path."""
    path = run_dir / "logs" / CONTROLLER_LOG
    path.parent.mkdir(parents=True, exist_ok=True)
    root = logging.getLogger()
    for h in root.handlers:
        if isinstance(h, logging.FileHandler) and Path(h.baseFilename) == path.resolve():
            return path
    handler = logging.FileHandler(path, encoding="utf-8")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root.addHandler(handler)
    return path

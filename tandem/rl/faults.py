"""Fault injection for recovery tests: `TANDEM_FAULT_KILL=<phase>@<step>` makes `tandem train`
SIGKILL its whole process group when the loop reaches `phase` (rollout, train, sync, checkpoint)
of step `step`, optionally `delay_s` later (from a timer thread, so the kill lands in the middle of
that phase's work). Unset (always, outside tests), `kill_point` does nothing."""

from __future__ import annotations

import logging
import os
import signal
import threading

ENV = "TANDEM_FAULT_KILL"
PHASES = ("rollout", "train", "sync", "checkpoint")

logger = logging.getLogger("tandem.run")


def kill_point(phase: str, step: int, delay_s: float = 0.0) -> None:
    if os.environ.get(ENV) != f"{phase}@{step}":
        return
    logger.warning("%s=%s: killing the process group%s", ENV, os.environ[ENV],
                   f" in {delay_s:.2f} s" if delay_s else "")
    if delay_s > 0:
        threading.Timer(delay_s, _kill).start()
    else:
        _kill()


def _kill() -> None:
    os.killpg(os.getpgrp(), signal.SIGKILL)

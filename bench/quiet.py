"""Wait for the machine to go quiet before a timed repetition.

A server that has just finished work can keep a core busy for a while: vLLM's engine loop spins
for ~1.1 s after its last request (measured here: one core at 100% until then), so whatever a
benchmark times next would share the CPU with it. Interleaved repetitions made every side pay for
the one before it, tandem serve after vLLM's spin most of all (3.29 s instead of 2.26 s).
"""

from __future__ import annotations

import os
import time

TICK = os.sysconf("SC_CLK_TCK")


def busy_cores() -> float:
    """CPU seconds per second used by all processes over a 0.25 s window (Linux /proc)."""
    def ticks() -> int:
        with open("/proc/stat") as f:
            user, nice, system = (int(x) for x in f.readline().split()[1:4])
        return user + nice + system

    before = ticks()
    time.sleep(0.25)
    return (ticks() - before) / TICK / 0.25


def wait_quiet(threshold: float = 0.15, timeout_s: float = 15.0) -> float:
    """Return once every process together uses under `threshold` cores (or after `timeout_s`,
    printing what was still busy); -> the seconds waited."""
    start = time.monotonic()
    while (busy := busy_cores()) >= threshold:
        if time.monotonic() - start > timeout_s:
            print(f"  (the machine stayed busy: {busy:.2f} cores after {timeout_s:.0f} s; timing anyway)", flush=True)
            break
    return time.monotonic() - start

"""Identical warnings logged once, then as a running count.

An error that repeats for every episode or every eval item (a reward that always raises, a server
that refuses every request) would otherwise fill the console with thousands of identical
tracebacks. `RepeatCounter.log(key, msg)` logs the first occurrence of `key` in full (with the
traceback when given), then counts repeats and logs a one-line running count at most every
`interval_s` seconds; `flush()` logs the counts not reported yet. Thread-safe.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass


@dataclass
class _Seen:
    message: str  # as first logged
    total: int = 0
    unreported: int = 0  # repeats since the last line logged
    last_logged: float = 0.0


class RepeatCounter:
    def __init__(self, logger: logging.Logger, interval_s: float = 10.0, level: int = logging.WARNING):
        self.logger, self.interval_s, self.level = logger, interval_s, level
        self._seen: dict[str, _Seen] = {}
        self._lock = threading.Lock()

    def log(self, key: str, message: str, exc_info: BaseException | None = None) -> int:
        """Log `message` (and `exc_info`'s traceback) if `key` is new, else count it and log the
        running count once `interval_s` has passed since `key` was last logged; returns how often
        `key` has been seen."""
        now = time.monotonic()
        with self._lock:
            seen = self._seen.get(key)
            first = seen is None
            if seen is None:
                seen = self._seen[key] = _Seen(message)
            seen.total += 1
            total = seen.total
            report = 0
            if first:
                seen.last_logged = now
            else:
                seen.unreported += 1
                if now - seen.last_logged >= self.interval_s:
                    seen.last_logged, report, seen.unreported = now, seen.unreported, 0
        if first:
            self.logger.log(self.level, "%s", message, exc_info=exc_info)
        elif report:
            self._log_count(seen.message, report, total)
        return total

    def count(self, key: str) -> int:
        with self._lock:
            seen = self._seen.get(key)
            return 0 if seen is None else seen.total

    def flush(self) -> None:
        """Log the running count of every message with repeats not reported yet."""
        with self._lock:
            pending = [(s.message, s.unreported, s.total) for s in self._seen.values() if s.unreported]
            for s in self._seen.values():
                s.unreported = 0
        for message, repeats, total in pending:
            self._log_count(message, repeats, total)

    def _log_count(self, message: str, repeats: int, total: int) -> None:
        self.logger.log(self.level, "%s [again %d time(s); %d in total]", message, repeats, total)

"""Package attributes loaded on first use (PEP 562), so importing a package stays cheap.

    _LAZY = {"LocalScheduler": "tandem.launch.local", ...}
    __getattr__ = lazy_attributes(__name__, _LAZY)

`from tandem.launch import LocalScheduler` then imports `tandem.launch.local` only when asked.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any


def lazy_attributes(package: str, table: Mapping[str, str]) -> Callable[[str], Any]:
    """A module `__getattr__` resolving each name in `table` from the module it maps to."""

    def __getattr__(name: str) -> Any:
        if name in table:
            return getattr(importlib.import_module(table[name]), name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__

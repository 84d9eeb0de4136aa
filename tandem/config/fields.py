"""The one helper every config dataclass uses to declare a field with its documentation."""

from __future__ import annotations

from dataclasses import field
from typing import Any


def config_field(default: Any, help: str, **meta: Any) -> Any:
    """A dataclass field with a default and metadata: `help` text, and optionally `choices` (the
    allowed values) and `min` (a numeric floor), which `tandem.config.loader.validate` enforces."""
    return field(default=default, metadata={"help": help, **meta})

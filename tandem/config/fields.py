"""The one helper every config dataclass uses to declare a field with its documentation."""

from __future__ import annotations

import dataclasses
from dataclasses import field
from typing import Any


def config_field(default: Any, help: str, **meta: Any) -> Any:
    """A dataclass field with a default and metadata: `help` text, and optionally `choices` (the
    allowed values) and `min` (a numeric floor), which `tandem.config.loader.validate` enforces."""
    return field(default=default, metadata={"help": help, **meta})


def check_field_metadata(section: Any, prefix: str = "") -> None:
    """Enforce `choices` and `min` on a section's own fields (not its sub-sections); raises
    `ConfigError` naming the field. `tandem.config.loader.validate` applies it to every section."""
    from tandem.errors import ConfigError

    for f in dataclasses.fields(section):
        value = getattr(section, f.name)
        if dataclasses.is_dataclass(value):
            continue
        key = f"{prefix}{f.name}"
        choices = f.metadata.get("choices")
        if choices is not None and value not in choices:
            raise ConfigError(f"{key}: {value!r} is not one of {', '.join(map(repr, choices))}")
        floor = f.metadata.get("min")
        if floor is not None and value is not None and value < floor:
            raise ConfigError(f"{key}: {value!r} is below the minimum {floor!r}")

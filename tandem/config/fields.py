"""Field metadata of config dataclasses: `config_field` declares a field with its documentation,
choices and range; `validate` enforces them (and each section's `check`) on a whole config."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import field
from typing import Any

from tandem.errors import ConfigError

_BOUNDS = ("min", "gt", "max", "lt")


def config_field(default: Any, help: str, **meta: Any) -> Any:
    """A dataclass field with a default and metadata: `help` text, and optionally `choices` (the
    allowed values) and bounds, `min` / `max` (inclusive) and `gt` / `lt` (exclusive), which
    `validate` enforces and the keys table documents; `resolve`, a function `(value, base_dir) ->
    value` the loader applies to a value as it reads it, with the directory of the config file
    that holds it (the working directory for overrides): for values that hold a relative path."""
    unknown = set(meta) - {"choices", "resolve", *_BOUNDS}
    if unknown:
        raise TypeError(f"config_field: unknown metadata {sorted(unknown)}")
    return field(default=default, metadata={"help": help, **meta})


def describe_range(meta: Any) -> str | None:
    """A field's allowed interval in interval notation, e.g. '(0.0, 1.0]' or '[1, inf)'; None
    when it has no bounds."""
    if not any(b in meta for b in _BOUNDS):
        return None
    low = f"[{meta['min']}" if "min" in meta else f"({meta['gt']}" if "gt" in meta else "(-inf"
    high = f"{meta['max']}]" if "max" in meta else f"{meta['lt']})" if "lt" in meta else "inf)"
    return f"{low}, {high}"


def range_problem(value: Any, meta: Any) -> str | None:
    """Why `value` falls outside the bounds in `meta` (None when it is inside, or None-valued)."""
    if value is None or isinstance(value, bool) or not isinstance(value, int | float):
        return None
    if "min" in meta and value < meta["min"]:
        return f"{value!r} is below the minimum {meta['min']!r}"
    if "gt" in meta and value <= meta["gt"]:
        return f"{value!r} must be greater than {meta['gt']!r}"
    if "max" in meta and value > meta["max"]:
        return f"{value!r} is above the maximum {meta['max']!r}"
    if "lt" in meta and value >= meta["lt"]:
        return f"{value!r} must be less than {meta['lt']!r}"
    return None


_YAML_BOOLEANS = {"false": "off", "true": "on"}


def check_field_metadata(section: Any, prefix: str = "") -> None:
    """Enforce `choices` and bounds on a section's own fields (not its sub-sections), and refuse
    NaN and infinities in float fields; raises `ConfigError` naming the field, its allowed values
    and how to fix it. `validate` applies it to every section."""
    for f in dataclasses.fields(section):
        value = getattr(section, f.name)
        if dataclasses.is_dataclass(value):
            continue
        key = f"{prefix}{f.name}"
        choices = f.metadata.get("choices")
        if choices is not None and value not in choices and str(value).lower() in _YAML_BOOLEANS:
            # YAML 1.1 reads a bare `off` / `on` as a boolean (OmegaConf then stores 'False' in a
            # str field); where the choices name that word, it can only have meant it.
            word = _YAML_BOOLEANS[str(value).lower()]
            if word in choices:
                value = word
                setattr(section, f.name, word)
        if choices is not None and value not in choices:
            raise ConfigError(f"{key}: {value!r} is not one of {', '.join(map(repr, choices))}")
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{key}: {value!r} is not a finite number; set {key} to a number")
        problem = range_problem(value, f.metadata)
        if problem is not None:
            raise ConfigError(f"{key}: {problem}; set {key} to a value in {describe_range(f.metadata)}")


def validate(cfg: Any, prefix: str = "") -> None:
    """Check field metadata (`choices`, bounds) and run each section's `check(prefix)`, depth
    first, on a config dataclass and every section nested in it; raises `ConfigError` naming the
    dotted key. The loader runs it on what it loads; components run it on configs built in code."""
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if dataclasses.is_dataclass(value):
            validate(value, prefix=f"{prefix}{f.name}.")
    check_field_metadata(cfg, prefix)
    check = getattr(cfg, "check", None)
    if callable(check):
        check(prefix)

"""Load a config: schema defaults <- YAML file <- `key.sub=value` overrides, then validate
(`load_config(path, overrides, schema=...)`, `to_yaml(cfg)`).

Generic over a schema dataclass of values and nested sections; every failure is a `ConfigError`
naming the field (an unknown key also gets the closest valid keys anywhere in the schema). Optional
hooks on the schema class: `defaults_for(user_data)` builds the defaults from what the user wrote;
`DERIVED` maps keys the schema's `check` fills to what to set instead (refused in input, left out of
`to_yaml`); `MOVED` maps keys that no longer exist to their replacement. A field with `resolve`
metadata holds relative paths, resolved from the directory of the file they came from (the working
directory for overrides)."""

from __future__ import annotations

import dataclasses
import difflib
import typing
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from tandem.config.fields import validate
from tandem.errors import ConfigError

T = TypeVar("T")


def load_config(path: str | Path | None, overrides: Sequence[str] = (), *, schema: type[T]) -> T:
    """Return a validated `schema` instance from an optional YAML file and dotted overrides."""
    layers: list[tuple[str, dict]] = []
    if path is not None:
        layers.append((f"config file {str(path)!r}", _read_yaml(Path(path))))
    if overrides:
        layers.append(("command-line overrides", _parse_overrides(overrides)))

    # Our own walk before OmegaConf merges: an unknown key gets its full dotted path and the closest
    # keys anywhere (`lr=1e-5` at the top level learns about `actor.optimizer.lr`).
    for source, data in layers:
        _check_keys(schema, data, prefix="", source=source, root=schema)
    bases = ([Path(path).absolute().parent] if path is not None else []) + ([Path.cwd()] if overrides else [])
    layers = [(source, _resolve_paths(schema, data, base)) for (source, data), base in zip(layers, bases, strict=True)]

    merged = OmegaConf.structured(_defaults(schema, [data for _, data in layers]))
    for source, data in layers:
        try:
            merged = OmegaConf.merge(merged, OmegaConf.create(data))
        except OmegaConfBaseException as exc:
            raise _type_error(schema, exc, source) from None
    try:
        cfg = OmegaConf.to_object(merged)
    except OmegaConfBaseException as exc:  # e.g. an interpolation that names a missing key
        raise ConfigError(f"cannot resolve config: {_first_line(exc)}") from None
    validate(cfg)  # field metadata (`choices`, bounds) and each section's `check()`
    return cfg  # type: ignore[return-value]


def _defaults(schema: type[T], layers: list[dict]) -> T:
    """The schema's defaults; a schema with `defaults_for(user_data)` derives them from the user's
    choices (e.g. an algorithm recipe named in the config)."""
    defaults_for = getattr(schema, "defaults_for", None)
    if defaults_for is None:
        return schema()
    user: dict = {}
    for data in layers:
        user = _deep_merge(user, data)
    return defaults_for(user)


def _deep_merge(base: dict, update: Mapping) -> dict:
    out = dict(base)
    for key, value in update.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), dict):
            out[key] = _deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def derived_keys(schema: type) -> Mapping[str, str]:
    """The schema's `DERIVED` keys (dotted key -> what to set instead); empty without."""
    return getattr(schema, "DERIVED", {})


def moved_keys(schema: type) -> Mapping[str, str]:
    """The schema's `MOVED` keys (dotted key that no longer exists -> what replaced it); empty without."""
    return getattr(schema, "MOVED", {})


def to_dict(cfg: Any) -> dict[str, Any]:
    """The resolved config as nested plain values, without its derived keys: what `to_yaml`
    writes (and what trackers take as a run's config)."""
    data = OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True)
    for key in derived_keys(type(cfg)):
        *sections, leaf = key.split(".")
        node = data
        for part in sections:
            node = node[part]  # type: ignore[index]
        del node[leaf]  # type: ignore[union-attr]
    return data  # type: ignore[return-value]


def to_yaml(cfg: Any) -> str:
    """The resolved config as YAML (what a run records next to its outputs), without its derived
    keys, so that `load_config` reads it back to an equal config."""
    return OmegaConf.to_yaml(to_dict(cfg))


def schema_keys(schema: type, prefix: str = "") -> Iterator[tuple[str, dataclasses.Field]]:
    """Every leaf key of a schema as (dotted path, dataclass field), in declaration order."""
    hints = typing.get_type_hints(schema)
    for f in dataclasses.fields(schema):
        ftype = hints[f.name]
        if dataclasses.is_dataclass(ftype):
            yield from schema_keys(ftype, prefix=f"{prefix}{f.name}.")
        else:
            yield f"{prefix}{f.name}", f


# --- reading ----------------------------------------------------------------------------------


def _read_yaml(path: Path) -> dict:
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} does not exist; pass the path of a YAML file")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {str(path)!r} is not valid YAML: {exc}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {str(path)!r} must hold a mapping of sections, got {type(data).__name__}")
    return data


def _parse_overrides(overrides: Sequence[str]) -> dict:
    for item in overrides:
        key = item.split("=", 1)[0]
        if "=" not in item or not key or any(not part for part in key.split(".")):
            raise ConfigError(f"override {item!r} must look like key.sub=value (e.g. actor.optimizer.lr=1e-5)")
    try:
        return OmegaConf.to_container(OmegaConf.from_dotlist(list(overrides)))  # type: ignore[return-value]
    except OmegaConfBaseException as exc:
        raise ConfigError(f"cannot parse overrides: {_first_line(exc)}") from None


# --- key and type checks -----------------------------------------------------------------------


def _check_keys(schema: type, data: Mapping, prefix: str, source: str, root: type) -> None:
    hints = typing.get_type_hints(schema)
    fields = [f.name for f in dataclasses.fields(schema)]
    derived = derived_keys(root)
    moved = moved_keys(root)
    for key, value in data.items():
        full = f"{prefix}{key}"
        if full in moved and key not in fields:
            raise ConfigError(f"{full} is no longer a config key: use {moved[full]} instead (found {full} in {source})")
        if key not in fields:
            raise ConfigError(_unknown_key_message(str(key), prefix, fields, source, root))
        if full in derived:
            raise ConfigError(f"{full} is derived, not set: set {derived[full]} instead (found {full} in {source})")
        ftype = hints[key]
        if dataclasses.is_dataclass(ftype):
            if isinstance(value, Mapping):
                _check_keys(ftype, value, prefix=f"{full}.", source=source, root=root)
            elif value is not None:
                keys = [f.name for f in dataclasses.fields(ftype) if f"{full}.{f.name}" not in derived]
                raise ConfigError(
                    f"{full}: expected a section (a mapping of keys such as {', '.join(keys)}), got {value!r} "
                    f"in {source}"
                )


def _resolve_paths(schema: type, data: Mapping, base: Path) -> dict:
    """`data` with each value of a field that has a `resolve` hook passed through it (against
    `base`); interpolations (`${...}`) are left for OmegaConf."""
    hints = typing.get_type_hints(schema)
    fields = {f.name: f for f in dataclasses.fields(schema)}
    out = dict(data)
    for key, value in data.items():
        ftype, f = hints[key], fields[key]
        if dataclasses.is_dataclass(ftype) and isinstance(value, Mapping):
            out[key] = _resolve_paths(ftype, value, base)
        elif "resolve" in f.metadata and not (isinstance(value, str) and "${" in value):
            out[key] = f.metadata["resolve"](value, base)
    return out


def _unknown_key_message(key: str, prefix: str, siblings: list[str], source: str, root: type) -> str:
    # Near-misses among the siblings first, then the same name in another section (a key written
    # in the wrong place), as full dotted paths; derived keys are not offered (they cannot be set).
    derived = derived_keys(root)
    siblings = [name for name in siblings if prefix + name not in derived]
    suggestions = [prefix + c for c in difflib.get_close_matches(key, siblings, n=3, cutoff=0.6)]
    suggestions += [p for p, _ in schema_keys(root)
                    if p.rsplit(".", 1)[-1] == key and p not in suggestions and p not in derived]
    msg = f"unknown config key {prefix + key!r} in {source}"
    if suggestions:
        msg += f"; did you mean {' or '.join(map(repr, suggestions))}?"
    where = f"under {prefix[:-1]!r}" if prefix else "at the top level"
    return msg + f" (valid keys {where}: {', '.join(siblings)})"


def _type_error(schema: type, exc: OmegaConfBaseException, source: str) -> ConfigError:
    key = getattr(exc, "full_key", None)
    value = getattr(exc, "value", None)
    if not key:
        return ConfigError(f"invalid value in {source}: {_first_line(exc)}")
    expected = _describe_type(_field_type(schema, key))
    return ConfigError(f"{key}: expected {expected}, got {value!r} (from {source})")


def _field_type(schema: type, dotted: str) -> Any:
    ftype: Any = schema
    for part in dotted.split("."):
        part = part.split("[", 1)[0]
        if not dataclasses.is_dataclass(ftype):
            break
        ftype = typing.get_type_hints(ftype)[part]
    return ftype


def _describe_type(ftype: Any) -> str:
    names = {int: "an integer", float: "a number (float)", bool: "a boolean (true/false)", str: "a string"}
    if ftype in names:
        return names[ftype]
    return getattr(ftype, "__name__", None) or str(ftype)


def _first_line(exc: BaseException) -> str:
    return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__


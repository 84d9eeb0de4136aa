"""Any fleet request or answer as JSON and back, from its dataclass fields' types alone.

`to_json(value)` turns dataclasses, tuples, lists and dicts of plain values into JSON values;
`from_json(tp, data)` rebuilds a value of type `tp` and raises `WireError` naming the field path
when `data` does not fit (a missing field without a default, a wrong type, an unknown field).
Supported types: dataclasses, `int`, `float`, `str`, `bool`, `None`, `X | None`, `tuple[X, ...]`,
`list[X]`, `dict[str, X]`, and `Any` (passed through).
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from typing import Any


class WireError(ValueError):
    """A JSON value does not fit the type it should decode to; the message names the field."""


def to_json(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: to_json(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, tuple | list):
        return [to_json(v) for v in value]
    if isinstance(value, dict):
        return {str(k): to_json(v) for k, v in value.items()}
    return value


def from_json(tp: Any, data: Any, path: str = "body") -> Any:
    origin = typing.get_origin(tp)
    if tp is Any:
        return data
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(tp)
        if data is None and type(None) in options:
            return None
        concrete = [o for o in options if o is not type(None)]
        if len(concrete) != 1:
            raise TypeError(f"{path}: unions other than `X | None` are not supported on the wire")
        return from_json(concrete[0], data, path)
    if origin in (tuple, list):
        if not isinstance(data, list):
            raise WireError(f"{path}: expected a list, got {type(data).__name__}")
        args = typing.get_args(tp)
        item = args[0] if args else Any
        if origin is tuple and not (len(args) == 2 and args[1] is Ellipsis):
            raise TypeError(f"{path}: only tuple[X, ...] is supported on the wire")
        return origin(from_json(item, v, f"{path}[{i}]") for i, v in enumerate(data))
    if origin is dict:
        if not isinstance(data, dict):
            raise WireError(f"{path}: expected an object, got {type(data).__name__}")
        value_type = typing.get_args(tp)[1]
        return {str(k): from_json(value_type, v, f"{path}.{k}") for k, v in data.items()}
    if dataclasses.is_dataclass(tp):
        return _dataclass_from_json(tp, data, path)
    return _scalar(tp, data, path)


def _dataclass_from_json(tp: type, data: Any, path: str) -> Any:
    if not isinstance(data, dict):
        raise WireError(f"{path}: expected an object, got {type(data).__name__}")
    hints = _hints(tp)
    fields = {f.name: f for f in dataclasses.fields(tp)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise WireError(f"{path}: unknown field(s) {unknown}; expected some of {sorted(fields)}")
    values = {}
    for name, f in fields.items():
        if name in data:
            values[name] = from_json(hints[name], data[name], f"{path}.{name}")
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise WireError(f"{path}.{name} is missing")
    return tp(**values)


@functools.cache
def _hints(tp: type) -> dict[str, Any]:
    return typing.get_type_hints(tp)


def _scalar(tp: Any, data: Any, path: str) -> Any:
    if tp is type(None):
        if data is not None:
            raise WireError(f"{path}: expected null, got {data!r}")
        return None
    if tp is bool:
        ok = isinstance(data, bool)
    elif tp is int:
        ok = isinstance(data, int) and not isinstance(data, bool)
    elif tp is float:
        ok = isinstance(data, int | float) and not isinstance(data, bool)
        data = float(data) if ok else data
    elif tp is str:
        ok = isinstance(data, str)
    else:
        raise TypeError(f"{path}: type {tp!r} is not supported on the wire")
    if not ok:
        raise WireError(f"{path}: expected {tp.__name__}, got {type(data).__name__} {data!r}")
    return data

"""The table of every config key (type, default, meaning) as Markdown, generated from the schema.

`docs/configuration.md` embeds it between markers and a test keeps the two identical;
`tandem show-config --keys` prints it.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any

from tandem.config.fields import describe_range
from tandem.config.loader import derived_keys, schema_keys

BEGIN, END = "<!-- keys:begin -->", "<!-- keys:end -->"


def _type_name(schema: type, dotted: str) -> str:
    ftype: Any = schema
    for part in dotted.split("."):
        ftype = typing.get_type_hints(ftype)[part]
    names = {int: "int", float: "float", bool: "bool", str: "str"}
    name = names.get(ftype) or str(ftype).replace("typing.", "")
    return name.replace("|", "\\|")  # a bare | would split the table cell


def _default(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        return repr(f.default)
    return repr(f.default_factory())  # type: ignore[misc]


def keys_markdown(schema: type, defaults: Any = None) -> str:
    """One row per leaf key a user can set (the schema's derived keys are left out); defaults are
    read from `defaults` (an instance) when given, so recipe-derived defaults show as they apply."""
    rows = ["| key | type | default | meaning |", "|---|---|---|---|"]
    derived = derived_keys(schema)
    for key, f in schema_keys(schema):
        if key in derived:
            continue
        value = defaults
        if value is not None:
            for part in key.split("."):
                value = getattr(value, part)
        default = repr(value) if defaults is not None else _default(f)
        meaning = f.metadata.get("help", "")
        if "choices" in f.metadata:
            meaning += " One of " + ", ".join(f"`{c}`" for c in f.metadata["choices"]) + "."
        if (bounds := describe_range(f.metadata)) is not None:
            meaning += f" Range {bounds}."
        rows.append(f"| `{key}` | {_type_name(schema, key)} | `{default}` | {meaning.replace('|', '/')} |")
    return "\n".join(rows)

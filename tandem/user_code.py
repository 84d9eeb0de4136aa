"""Code a user names in their config, by import path: `task.reward_fn: mypkg.rewards:score`."""

from __future__ import annotations

import importlib


def import_user_object(path: str) -> object:
    """The object at `path` ('package.module:name', the name may be dotted: 'mod:Class.attr').
    Raises ValueError for a path without ':', ImportError/AttributeError (or whatever importing
    the module raises) when it cannot be loaded."""
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"{path!r} must look like 'package.module:function'")
    obj: object = importlib.import_module(module_name)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj

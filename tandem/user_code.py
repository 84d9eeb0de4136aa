"""Code a user names in their config: `rollout.reward: mypkg.rewards:score` (an importable module)
or `rollout.reward: rewards/score.py:score` (a Python file).

A spec is split at its last ':' into where the code is and the attribute (which may be dotted:
'mod:Class.method'). The part before it is a file when it ends in `.py` or contains a '/';
otherwise it is a module name, imported with `importlib`. A file is imported as a module of its own
(a name derived from its absolute path, registered in `sys.modules`), once per process; its
directory is not put on `sys.path`.

Functions from a file cannot be pickled by reference into another process (their module name means
nothing there), so code that ships a user's function to worker processes (the reward pool) ships a
`UserFunction`: the spec, imported on first call in each process and cached there.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import re
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

from tandem.errors import ConfigError

SPEC_FORMS = "'package.module:function' or 'path/to/file.py:function'"

_LOCK = threading.RLock()
_FILE_MODULES: dict[str, ModuleType] = {}  # absolute path -> module, in this process
_FUNCTIONS: dict[str, Callable[..., Any]] = {}  # spec -> the function, in this process


def split_spec(spec: str) -> tuple[str, str]:
    """(module name or file path, attribute); ValueError when `spec` has neither form."""
    where, sep, attr = spec.rpartition(":")
    if not sep or not where or not attr:
        raise ValueError(f"{spec!r} must look like {SPEC_FORMS}")
    return where, attr


def is_file_spec(spec: str) -> bool:
    """True when `spec` names a Python file (its part before the last ':' ends in .py or has a '/')."""
    where = spec.rpartition(":")[0]
    return where.endswith(".py") or "/" in where


def absolute_spec(spec: Any, base: Path) -> Any:
    """`spec` with a relative file path made absolute against `base`; module specs, absolute paths
    and non-strings are returned as they are."""
    if not isinstance(spec, str) or not is_file_spec(spec):
        return spec
    where, _, attr = spec.rpartition(":")
    path = Path(where).expanduser()
    return spec if path.is_absolute() else f"{base / path}:{attr}"


def _import_file(path: Path) -> ModuleType:
    key = str(path)
    with _LOCK:
        module = _FILE_MODULES.get(key)
        if module is not None:
            return module
        if not path.is_file():
            raise FileNotFoundError(f"no such file: {key!r}")
        stem = re.sub(r"\W", "_", path.stem)
        name = f"_tandem_user_{stem}_{hashlib.sha1(key.encode()).hexdigest()[:10]}"
        loader_spec = importlib.util.spec_from_file_location(name, path)
        if loader_spec is None or loader_spec.loader is None:
            raise ImportError(f"cannot import {key!r} as a Python module")
        module = importlib.util.module_from_spec(loader_spec)
        sys.modules[name] = module  # dataclasses and pickling look classes up there
        try:
            loader_spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[name]
            raise
        _FILE_MODULES[key] = module
        return module


def import_user_object(spec: str) -> object:
    """The object `spec` names. Raises ValueError for a malformed spec, FileNotFoundError for a
    missing file, ImportError / AttributeError (or whatever importing the code raises) when it
    cannot be loaded. A relative file path is taken from the working directory."""
    where, attr = split_spec(spec)
    if is_file_spec(spec):
        obj: object = _import_file(Path(where).expanduser().absolute())
    else:
        obj = importlib.import_module(where)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


class UserFunction:
    """A picklable reference to the user's function at `spec`: it pickles as the spec, and imports
    the function on its first call in each process (cached for the process). A relative file path
    is made absolute when the reference is made, so every process finds the same file."""

    def __init__(self, spec: str):
        split_spec(spec)
        self.spec = absolute_spec(spec, Path.cwd())
        where, attr = split_spec(self.spec)
        # What errors call it (`RewardRunner` names a function by `__name__`): short for a file.
        self.__name__ = f"{Path(where).name}:{attr}" if is_file_spec(self.spec) else self.spec

    def __getstate__(self) -> dict[str, Any]:
        return {"spec": self.spec}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["spec"])

    def __eq__(self, other: object) -> bool:
        return isinstance(other, UserFunction) and other.spec == self.spec

    def __hash__(self) -> int:
        return hash(self.spec)

    def __repr__(self) -> str:
        return f"UserFunction({self.spec!r})"

    def load(self) -> Callable[..., Any]:
        fn = _FUNCTIONS.get(self.spec)
        if fn is None:
            obj = import_user_object(self.spec)
            if not callable(obj):
                raise TypeError(f"{self.spec!r} is a {type(obj).__name__}, not a function")
            fn = _FUNCTIONS[self.spec] = obj
        return fn

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.load()(*args, **kwargs)


def check_user_function(spec: str, key: str, *, args: Sequence[Any] = (), kwargs: Mapping[str, Any] | None = None,
                        signature: str = "(...)", relative_to: str = "the working directory") -> Callable[..., Any]:
    """The callable `spec` names, checked the way it will be called: with `args` and `kwargs` (bound
    with `inspect.Signature.bind_partial`, so keyword parameters the call may supply are not
    required). Each problem is a `ConfigError` naming `key` and the fix; `signature` is the
    parameter list to suggest, e.g. '(prompt_text, completion_text, ...) -> float', `relative_to`
    says where a relative file path was taken from."""
    try:
        where, attr = split_spec(spec)
    except ValueError:
        raise ConfigError(f"{key}: {spec!r} must look like {SPEC_FORMS}") from None
    if is_file_spec(spec):
        path = Path(where).expanduser().absolute()
        if not path.is_file():
            what = "is a directory, not a file" if path.is_dir() else "does not exist"
            raise ConfigError(f"{key}: the file {str(path)!r} {what}; give the path of a Python file and a function "
                              f"in it, e.g. {key}=rewards/my_reward.py:score (a relative path is taken from "
                              f"{relative_to})")
        try:
            module: object = _import_file(path)
        except Exception as exc:
            raise ConfigError(f"{key}: importing {str(path)!r} failed: {type(exc).__name__}: {exc}; fix the "
                              "file (it is imported as a module of its own)") from None
    else:
        try:
            module = importlib.import_module(where)
        except Exception as exc:  # ImportError, or whatever importing the user's module raised
            raise ConfigError(f"{key}: cannot import the module {where!r}: {type(exc).__name__}: {exc}; make it "
                              f"importable (installed or on PYTHONPATH), or name a file: {key}=path/to/file.py:"
                              f"{attr}") from None
    obj = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            defined = sorted(n for n, v in vars(module).items()
                             if callable(v) and not n.startswith("_") and getattr(v, "__module__", None)
                             == getattr(module, "__name__", None))
            known = f" (it defines: {', '.join(defined)})" if defined else ""
            raise ConfigError(f"{key}: {where!r} has no {attr!r}{known}; name a function defined there")
        obj = getattr(obj, part)
    if not callable(obj):
        kind = type(obj).__name__
        raise ConfigError(f"{key}: {spec!r} is {'an' if kind[0] in 'aeiou' else 'a'} {kind}, not a function; name "
                          f"a function defined as def <name>{signature}")
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):  # builtins without a signature: the call will tell
        return obj  # type: ignore[return-value]
    try:
        sig.bind_partial(*args, **(kwargs or {}))
    except TypeError as exc:
        name = attr.rpartition(".")[2]
        raise ConfigError(f"{key}: {name}{sig} cannot take the arguments it will be called with ({exc}); define "
                          f"it as def {name}{signature}") from None
    return obj  # type: ignore[return-value]

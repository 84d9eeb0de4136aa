"""`tandem/openai_compat/` is pure protocol, shared by two servers: it imports the standard
library's basics and `tandem.errors`, never a web framework, torch, transformers or the engine."""

from __future__ import annotations

from pathlib import Path

from tests.config.test_rooms import imported_modules

ROOM = Path(__file__).resolve().parents[2] / "tandem" / "openai_compat"
ALLOWED = {"__future__", "json", "dataclasses", "uuid", "time", "typing", "collections.abc", "tandem.errors"}


def test_openai_compat_imports_only_the_protocol_basics():
    modules = sorted(ROOM.glob("*.py"))
    assert len(modules) >= 4
    outside = [f"{path.name}:{line} imports {name}" for path in modules for line, name in imported_modules(path)
               if name not in ALLOWED and not name.startswith("tandem.openai_compat")]
    assert not outside, "tandem/openai_compat must stay pure protocol:\n" + "\n".join(outside)

"""`tandem/config/` is the lowest room: every other room may import it, so it imports no other
room but `tandem.errors` (a loop would let the config room pull in torch, the launcher, ...)."""

from __future__ import annotations

import ast
from pathlib import Path

CONFIG_ROOM = Path(__file__).resolve().parents[2] / "tandem" / "config"
ALLOWED = ("tandem.config", "tandem.errors")


def imported_modules(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every import in the file, at any depth (function-level ones too); a
    relative import is resolved against the package."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = "tandem.config".rsplit(".", node.level - 1)[0]
                found.append((node.lineno, f"{base}.{node.module}" if node.module else base))
            else:
                found.append((node.lineno, node.module or ""))
    return found


def test_config_room_imports_no_other_tandem_room():
    modules = sorted(CONFIG_ROOM.glob("*.py"))
    assert len(modules) >= 8  # the walk found the room
    outside = [
        f"{path.name}:{line} imports {name}"
        for path in modules
        for line, name in imported_modules(path)
        if (name == "tandem" or name.startswith("tandem.")) and not any(
            name == room or name.startswith(room + ".") for room in ALLOWED
        )
    ]
    assert not outside, "tandem/config must import only tandem.config.* and tandem.errors:\n" + "\n".join(outside)


def test_the_walk_sees_function_level_imports(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("def f():\n    from tandem.launch.affinity import parse_cpus\n    import tandem.rl\n")
    assert [name for _, name in imported_modules(module)] == ["tandem.launch.affinity", "tandem.rl"]

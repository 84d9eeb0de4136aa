"""Rooms import downward only (issue 41).

The order of the rooms is declared once, in the `rooms` block of docs/architecture.md, lowest
first; rooms on one line are peers. An import from a room to one on a higher line, or to a peer,
fails here, whatever its form: module level, inside a function, under `TYPE_CHECKING`, or a
module named by a string (a lazy attribute table, a registry entry).
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "tandem"
ARCHITECTURE = ROOT / "docs" / "architecture.md"
MODULE_STRING = re.compile(r"^tandem(\.[a-z_0-9]+)*(:[A-Za-z_0-9]+)?$")


@dataclass(frozen=True)
class Import:
    importer: str  # dotted module name
    target: str  # dotted module name (or module.attribute, resolved by `_module_of`)
    kind: str  # "module", "function", "type-checking" or "string"
    where: str  # path:line


def declared_rooms(text: str) -> list[list[str]]:
    """The lines of the ```rooms block, lowest first; each a list of dotted room names."""
    block = re.search(r"```rooms\n(.*?)```", text, re.S)
    assert block, f"{ARCHITECTURE} has no ```rooms block"
    return [line.split("#")[0].split() for line in block.group(1).splitlines() if line.split("#")[0].strip()]


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _module_of(target: str) -> str | None:
    """The longest prefix of `target` that is a module of the package (drops `from x import attr`'s attr)."""
    parts = target.split(".")
    while parts:
        base = PACKAGE.parent.joinpath(*parts)
        if base.with_suffix(".py").is_file() or (base / "__init__.py").is_file():
            return ".".join(parts)
        parts.pop()
    return None


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _is_logger_name(node: ast.Constant, parents: dict[ast.AST, ast.AST]) -> bool:
    call = parents.get(node)
    return isinstance(call, ast.Call) and getattr(call.func, "attr", getattr(call.func, "id", "")) == "getLogger"


def _is_process_entry(node: ast.Constant, parents: dict[ast.AST, ast.AST]) -> bool:
    """`[python, "-m", "tandem.cli", ...]`: a module run as another process, not imported."""
    seq = parents.get(node)
    if not isinstance(seq, ast.List | ast.Tuple):
        return False
    i = seq.elts.index(node)
    return i > 0 and isinstance(seq.elts[i - 1], ast.Constant) and seq.elts[i - 1].value == "-m"


def imports_of(path: Path) -> list[Import]:
    tree = ast.parse(path.read_text())
    module = module_name(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    found: list[Import] = []

    def add(target: str, kind: str, node: ast.AST) -> None:
        if target == "tandem" or target.startswith("tandem."):
            found.append(Import(module, target, kind, f"{path.relative_to(ROOT)}:{node.lineno}"))

    def visit(node: ast.AST, kind: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child.test):
                for stmt in child.body:
                    visit_stmt(stmt, "type-checking")
                for stmt in child.orelse:
                    visit_stmt(stmt, kind)
            else:
                visit_stmt(child, kind)

    def visit_stmt(node: ast.AST, kind: str) -> None:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            visit(node, "function" if kind == "module" else kind)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name, kind, node)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join(anchor + ([node.module] if node.module else []))
            for alias in node.names:  # `from tandem.x import y`: y may be a module or an attribute
                add(f"{base}.{alias.name}", kind, node)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and MODULE_STRING.match(node.value):
            if not _is_logger_name(node, parents) and not _is_process_entry(node, parents):
                add(node.value.split(":")[0], "string", node)
            visit(node, kind)
        else:
            visit(node, kind)

    visit(tree, "module")
    return found


def room_of(module: str, rooms: list[str]) -> str | None:
    """The declared room a module belongs to: `tandem` is the package's own `__init__` only;
    otherwise the longest declared prefix (`inference.server` before `inference`)."""
    if module == "tandem":
        return "tandem" if "tandem" in rooms else None
    rest = module.removeprefix("tandem.")
    matches = [r for r in rooms if r != "tandem" and (rest == r or rest.startswith(r + "."))]
    return max(matches, key=len, default=None)


def all_imports() -> list[Import]:
    return [imp for path in sorted(PACKAGE.rglob("*.py")) for imp in imports_of(path)]


def layering_violations(lines: list[list[str]], imports: list[Import]) -> list[str]:
    level = {room: i for i, line in enumerate(lines) for room in line}
    rooms = list(level)
    bad: list[str] = []
    for imp in imports:
        target = _module_of(imp.target)
        if target is None:
            continue
        a, b = room_of(imp.importer, rooms), room_of(target, rooms)
        if a is None or b is None or a == b:
            continue
        if level[b] > level[a]:
            bad.append(f"{imp.where}: {a} imports {target} ({b}, a higher room) [{imp.kind}]")
        elif level[b] == level[a]:
            bad.append(f"{imp.where}: {a} imports {target} ({b}, a peer on the same line) [{imp.kind}]")
    return list(dict.fromkeys(bad))  # `from m import a, b` is one import of m


@pytest.fixture(scope="module")
def lines() -> list[list[str]]:
    return declared_rooms(ARCHITECTURE.read_text())


def test_every_module_belongs_to_a_declared_room(lines):
    rooms = [room for line in lines for room in line]
    assert len(rooms) == len(set(rooms)), f"a room is declared twice: {rooms}"
    orphans = sorted({module_name(p) for p in PACKAGE.rglob("*.py") if room_of(module_name(p), rooms) is None})
    assert not orphans, f"modules in no room of docs/architecture.md's rooms block (declare their room): {orphans}"
    missing = [r for r in rooms if r != "tandem" and _module_of("tandem." + r) != "tandem." + r]
    assert not missing, f"the rooms block names rooms that do not exist: {missing}"


def test_rooms_import_downward_only(lines):
    bad = layering_violations(lines, all_imports())
    assert not bad, "imports that go up or sideways between rooms:\n" + "\n".join(bad)


def test_the_check_sees_every_form_of_import(tmp_path, monkeypatch):
    """The walker itself: each form of import is found, a logger name is not."""
    source = (
        "from typing import TYPE_CHECKING\n"
        "import tandem.config.loader\n"
        "from tandem.rl import trainer\n"
        "if TYPE_CHECKING:\n"
        "    from tandem.train.engine import TrainEngine\n"
        "def f():\n"
        "    from tandem.rollout.client import InferenceClient\n"
        "_LAZY = {'X': 'tandem.fleet.ops', 'Y': 'tandem.data.tasks.rewards:exact'}\n"
        "logger = logging.getLogger('tandem.launch')\n"
        "cmd = [sys.executable, '-m', 'tandem.cli', 'serve']\n"
    )
    module = PACKAGE / "algo" / "_layering_probe.py"
    monkeypatch.setattr(Path, "read_text", lambda self: source if self == module else Path.read_bytes(self).decode())
    found = {(i.target, i.kind) for i in imports_of(module)}
    assert found == {("tandem.config.loader", "module"), ("tandem.rl.trainer", "module"),
                     ("tandem.train.engine.TrainEngine", "type-checking"),
                     ("tandem.rollout.client.InferenceClient", "function"),
                     ("tandem.fleet.ops", "string"), ("tandem.data.tasks.rewards", "string")}
    lines = [["errors"], ["config", "data"], ["algo", "fleet"], ["train", "rollout"], ["rl"]]
    bad = layering_violations(lines, imports_of(module))
    assert len(bad) == 4 and not any("config" in b for b in bad), bad

"""`make review`: figures a reviewer reads instead of a size rule (issue 41).

Prints the largest modules and functions of `tandem/` and every tandem import that is not at module
level (each should defer a heavy dependency and say so, or break no boundary); the layering itself
is enforced by tests/test_layering.py.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.test_layering import PACKAGE, _module_of, all_imports  # noqa: E402


def main(top: int = 10) -> None:
    modules, functions = [], []
    for path in sorted(PACKAGE.rglob("*.py")):
        text = path.read_text()
        rel = path.relative_to(ROOT)
        modules.append((len(text.splitlines()), str(rel)))
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                functions.append((node.end_lineno - node.lineno + 1, f"{rel}:{node.lineno} {node.name}"))
    print(f"largest modules (of {len(modules)}, {sum(n for n, _ in modules)} lines):")
    for n, name in sorted(modules, reverse=True)[:top]:
        print(f"  {n:5d}  {name}")
    print("largest functions:")
    for n, name in sorted(functions, reverse=True)[:top]:
        print(f"  {n:5d}  {name}")
    deferred = sorted({(i.where, i.kind, _module_of(i.target) or i.target) for i in all_imports()
                       if i.kind in ("function", "type-checking")})
    print(f"tandem imports inside functions or under TYPE_CHECKING: {len(deferred)}")
    for where, kind, target in deferred:
        path, line = where.split(":")
        text = (ROOT / path).read_text().splitlines()[int(line) - 1]
        reason = text.split("#", 1)[1].strip() if "#" in text else ""
        print(f"  {where:45s} {kind:13s} {target}" + (f"  ({reason})" if reason else ""))


if __name__ == "__main__":
    main()

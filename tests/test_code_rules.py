"""A rule the code keeps (issue 18): no code named by a 'package.module:function' string (the
trainer is driven by typed methods; only a user's own `rollout.reward` is a path). Modules are
split by job, not by size (issue 41): `make review` prints the largest modules and functions."""

from __future__ import annotations

import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "tandem"
FUNCTION_PATH = re.compile(r'"tandem\.[a-z_.]+:[a-z_]+"')


def test_no_function_is_named_by_a_string():
    hits = [f"{p.relative_to(PACKAGE)}:{i}: {line.strip()}" for p in PACKAGE.rglob("*.py")
            for i, line in enumerate(p.read_text().splitlines(), 1) if FUNCTION_PATH.search(line)]
    assert not hits, "call code through typed methods, not 'tandem.x:y' strings:\n" + "\n".join(hits)

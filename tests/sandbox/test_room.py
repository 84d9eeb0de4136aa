"""`tandem/sandbox/` runs in reward workers and the CLI alike and sits low among the rooms: it
imports the standard library, `tandem.config` and `tandem.errors` only (no torch, no third-party
package)."""

from __future__ import annotations

import sys
from pathlib import Path

from tests.config.test_rooms import imported_modules

ROOM = Path(__file__).resolve().parents[2] / "tandem" / "sandbox"


def test_sandbox_imports_only_the_standard_library_config_and_errors():
    modules = sorted(ROOM.glob("*.py"))
    assert len(modules) >= 6
    outside = [f"{path.name}:{line} imports {name}" for path in modules for line, name in imported_modules(path)
               if name.split(".")[0] not in sys.stdlib_module_names
               and not name.startswith(("tandem.sandbox", "tandem.config", "tandem.errors"))]
    assert not outside, "tandem/sandbox imports beyond the standard library, config and errors:\n" + "\n".join(outside)

"""Suite-wide: how `make test` splits the suite between its two pytest-xdist workers
(`-n 2 --dist loadgroup`). Each test module runs whole on one worker, so its module-scoped
fixtures (servers, trained runs) start once; the modules that share one expensive package-scoped
fixture (the vLLM server, the Slurm cluster) run on the same worker, so it starts once."""

from __future__ import annotations

import pytest

SHARED_FIXTURE_GROUPS = {  # path prefix -> group: the modules that share the fixture
    "tests/engines/": "vllm-server",
    "tests/launch/test_slurm_": "slurm-cluster",
}


def xdist_group_of(nodeid: str) -> str:
    module = nodeid.split("::", 1)[0]
    for prefix, group in SHARED_FIXTURE_GROUPS.items():
        if module.startswith(prefix):
            return group
    return module


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        item.add_marker(pytest.mark.xdist_group(xdist_group_of(item.nodeid)))

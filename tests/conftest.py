"""Suite-wide: how `make test` splits the suite between its two pytest-xdist workers (`-n 2`).
Each test module runs whole on one worker, so its module-scoped fixtures (servers, trained runs)
start once; the modules that share one expensive package-scoped fixture (the vLLM server, the
Slurm cluster) run on the same worker, so it starts once.

(This is a scheduler of our own rather than `--dist loadgroup`: pytest-xdist 3.8 names a test's
group by editing `item._nodeid`, which pytest 9 no longer reads, so its groups have no effect.)"""

from __future__ import annotations

import pytest

SHARED_FIXTURE_GROUPS = {  # path prefix -> group: the modules that share the fixture
    "tests/engines/test_vllm.py": "vllm-server",  # test_vllm_train.py launches servers of its own
    "tests/engines/test_vllm_update.py": "vllm-server",
    "tests/launch/test_slurm_": "slurm-cluster",
}


def worker_group_of(nodeid: str) -> str:
    """The unit one worker runs whole: the test's module, or its shared-fixture group."""
    module = nodeid.split("::", 1)[0]
    for prefix, group in SHARED_FIXTURE_GROUPS.items():
        if module.startswith(prefix):
            return group
    return module


@pytest.hookimpl(optionalhook=True)  # a pytest-xdist hook: called only when the suite runs with -n
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    from xdist.scheduler import LoadScopeScheduling

    class ModuleScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return worker_group_of(nodeid)

    return ModuleScheduling(config, log)

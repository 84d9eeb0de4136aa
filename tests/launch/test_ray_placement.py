"""A placement the Ray cluster could never hold (its total resources, not the free ones) is refused
before any placement group waits, for each strategy. Ray's node table is given here; the refusal
against a real cluster is in test_ray_scheduler.py. Also what the private cluster's sizing logs."""

from __future__ import annotations

import pytest

ray = pytest.importorskip("ray")

from tandem.launch.config import RaySchedulerConfig  # noqa: E402
from tandem.launch.ray_cluster import RayScheduler  # noqa: E402
from tandem.launch.scheduler import LaunchError  # noqa: E402


def _scheduler(strategy: str) -> RayScheduler:
    sched = object.__new__(RayScheduler)  # no Ray started: only the check's inputs are set
    sched.config = RaySchedulerConfig(strategy=strategy)
    return sched


NODES = [{"Alive": True, "Resources": {"CPU": 4.0, "GPU": 2.0}},
         {"Alive": True, "Resources": {"CPU": 4.0}},
         {"Alive": False, "Resources": {"CPU": 64.0}}]  # a dead node counts for nothing


@pytest.mark.parametrize("strategy,bundles,ok", [
    ("PACK", [{"CPU": 1.0}] * 8, True),  # 8 of 8 CPUs, over two nodes
    ("PACK", [{"CPU": 1.0}] * 9, False),
    ("SPREAD", [{"CPU": 5.0}], False),  # no node holds one bundle
    ("STRICT_PACK", [{"CPU": 1.0}] * 4, True),
    ("STRICT_PACK", [{"CPU": 1.0}] * 5, False),  # 5 CPUs on one node
    ("STRICT_SPREAD", [{"CPU": 1.0}] * 2, True),
    ("STRICT_SPREAD", [{"CPU": 1.0}] * 3, False),  # 3 nodes needed, 2 alive
    ("PACK", [{"CPU": 1.0, "GPU": 1.0}] * 2, True),
    ("PACK", [{"CPU": 1.0, "GPU": 1.0}] * 3, False),
])
def test_impossible_placements_are_refused_at_once(monkeypatch, strategy, bundles, ok):
    monkeypatch.setattr(ray, "nodes", lambda: NODES)
    sched = _scheduler(strategy)
    if ok:
        sched._refuse_impossible("actor", bundles)
        return
    with pytest.raises(LaunchError, match="can never place") as info:
        sched._refuse_impossible("actor", bundles)
    assert "scheduler.ray.cpus_per_process" in str(info.value) and strategy in str(info.value)


def test_the_private_cluster_says_how_it_was_sized(monkeypatch, caplog):
    """More CPUs than the machine's: logged with the run's count; an explicit scheduler.ray.num_cpus
    below what the run reserves: a warning naming both keys (the count is honoured)."""
    from tandem.launch.scheduler import RunProcesses

    monkeypatch.setattr("os.cpu_count", lambda: 2)
    demo = RunProcesses(servers=2, ranks=2)
    sched = _scheduler("PACK")
    with caplog.at_level("INFO", logger="tandem.launch"):
        assert sched._private_cpus(demo) == 4
    assert ("gets 4 logical CPU(s), more than this machine's 2: the run's 2 server(s) + 2 trainer rank(s) x "
            "scheduler.ray.cpus_per_process=1 reserve 4 CPU(s)") in caplog.text
    caplog.clear()
    sched.config = RaySchedulerConfig(num_cpus=3)
    with caplog.at_level("INFO", logger="tandem.launch"):
        assert sched._private_cpus(demo) == 3
    warning = [r for r in caplog.records if r.levelname == "WARNING"]
    assert len(warning) == 1 and "scheduler.ray.num_cpus=3" in warning[0].getMessage(), caplog.text
    assert "raise scheduler.ray.num_cpus" in warning[0].getMessage()
    assert "scheduler.ray.cpus_per_process" in warning[0].getMessage()

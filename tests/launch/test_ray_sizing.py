"""The private Ray cluster Tandem starts is sized to the run (issue 43): what a run config's processes
reserve (`run_processes`), and the rule that turns it into the cluster's CPUs (`private_cpus`:
the machine's count raised to the run's needs; an explicit `scheduler.ray.num_cpus` wins). No Ray
here; the demo's shape starting on a real private cluster on this 2-CPU machine is in
test_ray_scheduler.py."""

from __future__ import annotations

import pytest

from tandem.launch.config import RaySchedulerConfig
from tandem.launch.scheduler import RunProcesses
from tandem.rl.cluster import run_processes
from tandem.rl.config import load_run_config
from tests.launch.procs import REPO

DEMO = REPO / "examples" / "demo.yaml"


@pytest.mark.parametrize("overrides,command,expected", [
    ([], "train", RunProcesses(servers=2, ranks=2)),  # the demo: tandem:d2, archon:d2
    (["rollout.backend=tandem:d3", "actor.backend=archon:d1"], "train", RunProcesses(servers=3, ranks=1)),
    (["rollout.servers=[http://127.0.0.1:9]"], "train", RunProcesses(servers=0, ranks=2)),  # servers by address
    (["algo.name=ppo", "critic.backend=archon:d2"], "train", RunProcesses(servers=2, ranks=4)),  # a critic group
    (["algo.name=ppo"], "train", RunProcesses(servers=2, ranks=2)),  # the critic on the actor's ranks
    ([], "sft", RunProcesses(servers=1, ranks=2)),  # `tandem sft`: one evaluation server
    (["task.eval_size=0"], "sft", RunProcesses(servers=0, ranks=2)),
    (["sft.objective=reward"], "sft", RunProcesses(servers=0, ranks=2)),  # scored on its trainer ranks
    # Scoring fleets launched with the run: a teacher's, a reward model's, a judge's servers.
    (["algo.name=distill", "teacher.path={model}", "teacher.backend=tandem:d1"], "train",
     RunProcesses(servers=3, ranks=2)),
    (["reward_model.path={model}", "reward_model.backend=tandem:d2"], "train", RunProcesses(servers=4, ranks=2)),
    (["judge.path={model}", "judge.backend=tandem:d1"], "train", RunProcesses(servers=3, ranks=2)),
    (["judge.path={model}", "judge.backend=sglang:d1", "judge.servers=[http://127.0.0.1:9]"], "train",
     RunProcesses(servers=2, ranks=2)),  # listed servers: none launched
])
def test_what_a_run_config_starts(tiny_model, overrides, command, expected):
    overrides = [o.format(model=tiny_model) for o in overrides]
    cfg = load_run_config(DEMO, [f"actor.path={tiny_model}", "scheduler.type=ray", *overrides], command=command)
    assert run_processes(cfg) == expected


def test_the_demo_on_two_cpus_gets_a_cluster_of_four(tiny_model):
    cfg = load_run_config(DEMO, [f"actor.path={tiny_model}", "scheduler.type=ray"])
    ray_cfg, processes = cfg.scheduler.ray, run_processes(cfg)
    assert ray_cfg.cpus_needed(processes) == 4
    assert ray_cfg.private_cpus(processes, machine_cpus=2) == 4  # oversubscribed, as the local launcher runs it
    assert ray_cfg.private_cpus(processes, machine_cpus=16) == 16  # never fewer than the machine has


@pytest.mark.parametrize("config,processes,machine,cpus", [
    (RaySchedulerConfig(), None, 2, 2),  # nothing known: the machine's count
    (RaySchedulerConfig(), RunProcesses(), 2, 2),
    (RaySchedulerConfig(cpus_per_process=0.5), RunProcesses(servers=2, ranks=3), 1, 3),  # 2.5 -> 3
    (RaySchedulerConfig(cpus_per_process=2.0), RunProcesses(servers=2, ranks=2), 2, 8),
    (RaySchedulerConfig(cpus_per_process=0.1), RunProcesses(servers=3, ranks=0), 1, 1),  # 0.3 -> 1 (no 0.3000004)
    # scheduler.ray.num_cpus set: honoured as given, more or fewer than the run needs
    (RaySchedulerConfig(num_cpus=3), RunProcesses(servers=2, ranks=2), 2, 3),
    (RaySchedulerConfig(num_cpus=1), RunProcesses(servers=2, ranks=2), 64, 1),
    (RaySchedulerConfig(num_cpus=32), RunProcesses(servers=2, ranks=2), 2, 32),
])
def test_the_sizing_rule(config, processes, machine, cpus):
    assert config.private_cpus(processes, machine_cpus=machine) == cpus


def test_counts_are_not_negative():
    with pytest.raises(ValueError, match="servers=-1"):
        RunProcesses(servers=-1)

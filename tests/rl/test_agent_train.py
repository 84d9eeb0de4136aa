"""`tandem train` with rollout.workflow=agent: the agent function runs through the proxy in a rollout
worker process, its chained calls are trained as one trajectory per run, and evaluation runs the
agent greedily."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from tandem.rollout.dump import read_dump
from tests.launch.procs import CHILD_ENV
from tests.rl.common import TANDEM, rl_rows, run_dir, write_config

pytestmark = pytest.mark.slow


def test_an_agent_trains_through_the_proxy(tmp_path, model_dir):
    dump = tmp_path / "dump"
    cfg = write_config(tmp_path, model_dir, actor={"backend": "archon:d1"},
                       rollout={"backend": "tandem:d1", "workflow": "agent", "workers": 1, "dump_dir": str(dump),
                                "agent": {"entry": "tests.rollout.agents:three_turns"}})
    proc = subprocess.run([TANDEM, "train", str(cfg)], capture_output=True, text=True, timeout=300,
                          env={**os.environ, **CHILD_ENV})
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = rl_rows(tmp_path)
    assert [r["step"] for r in rows] == [1, 2]
    evals = [json.loads(line) for line in (run_dir(tmp_path) / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in evals if "eval/calls" in r]
    assert evals and all(r["eval/calls"] == 3.0 and r["eval/failed"] == 0.0 for r in evals), evals
    trajs = [t for path in sorted(dump.glob("*.jsonl")) for t in read_dump(path)]
    assert len(trajs) >= 16  # 2 steps x 4 items x 2 runs
    groups: dict[str, list] = {}
    for t in trajs:
        groups.setdefault(t.group_id, []).append(t)
        assert t.num_turns == 3 and len(t.info["calls"]) == 3 and t.info["dropped_calls"] == 0
        spans = sum(1 for i, m in enumerate(t.loss_mask) if m and (i == 0 or not t.loss_mask[i - 1]))
        assert spans == 3  # three answers, the follow-up questions between them untrained
        assert 0.0 <= t.reward <= 1.0
    assert {len(g) for g in groups.values()} == {2}

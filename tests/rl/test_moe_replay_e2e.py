"""`tandem train` of a tiny Qwen3-MoE with routing replay r2, as a user runs it: the servers return
the routes of every token, the trainer replays its own proximal pass's routes in the update, and
each step logs the route agreement (fp32: the routers agree everywhere). r3 under expert
parallelism, with verified distributed updates, is tests/rl/test_moe_train.py."""

from __future__ import annotations

import subprocess

import pytest

from tandem.models.tiny import init_model
from tests.rl.common import TANDEM, rl_rows, write_config

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory):
    return init_model(tmp_path_factory.mktemp("model") / "moe-tiny", arch="qwen3_moe", preset="tiny", seed=0)


@pytest.mark.parametrize("replay, backend", [("r2", "archon:d1")])
def test_routing_replay_run(tmp_path, moe_model, replay, backend):
    cfg = write_config(tmp_path, moe_model, actor={"backend": backend, "router_replay": replay},
                       rollout={"backend": "tandem:d1", "max_head_offpolicyness": 0},
                       train={"total_steps": 2, "n_minibatches": 2})
    proc = subprocess.run([TANDEM, "train", str(cfg)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = rl_rows(tmp_path)
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["moe/route_agreement"] == 1.0 and r["moe/route_pairs"] > 0
        assert r["mismatch/max"] <= 1e-5, r["mismatch/max"]
        assert r["mismatch/n_tokens"] > 0

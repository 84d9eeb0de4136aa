"""`tandem train` on a tiny Qwen3-MoE with expert parallelism (archon:d2e2) and distributed weight
sync: the RL loop runs, every update is verified, and what the server holds is the trainer's model.

- every update is verified (`train.verify_weights`: per-tensor checksums of the server equal the
  trainer's export, expert pieces included, or the run fails);
- staleness 0 and fp32: the trainer's log-probs of the generated tokens, computed with the experts
  split over two ranks, equal the server's (`mismatch/max` <= 1e-5) and, with routing replay r3, the
  server's routes reach the trainer (`moe/route_agreement` is 1.0 in fp32), and the live-routed
  forward of `actor.router_replay_live_mismatch` agrees too (`moe/mismatch_live/max` <= 1e-5);
- after the run, the trainer's last checkpoint (saved under EP) loaded into a one-rank engine and
  written as HF weights gives, in transformers, the same greedy continuations as the server.
"""

from __future__ import annotations

import subprocess

import pytest

from tandem.models.tiny import init_model
from tests.inference.server_utils import ServerProcess
from tests.rl.common import TANDEM, rl_rows, run_dir, write_config
from tests.rl.served_model import assert_server_serves_the_checkpoint

pytestmark = pytest.mark.slow
STEPS = 2


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory):
    return init_model(tmp_path_factory.mktemp("m") / "moe-tiny", arch="qwen3_moe", preset="tiny", seed=0)


def test_rl_loop_with_expert_parallelism_and_routing_replay(tmp_path, moe_model):
    server = ServerProcess(moe_model, tmp_path)
    try:
        cfg = write_config(
            tmp_path, moe_model, actor={"backend": "archon:d2e2", "router_replay": "r3", "router_replay_live_mismatch": True},
            rollout={"backend": "tandem:d1", "servers": [server.url], "max_head_offpolicyness": 0},
            train={"total_steps": STEPS, "weight_sync": "distributed", "verify_weights": True, "save_every": STEPS})
        proc = subprocess.run([TANDEM, "train", str(cfg)], capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-4000:]
        log = (run_dir(tmp_path) / "logs" / "actor-rank0.log").read_text()
        assert "parallel dims:" in log and "ep=2" in log.split("parallel dims:")[1].splitlines()[0], log[-2000:]
        rows = rl_rows(tmp_path)
        assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
        for r in rows:
            assert r["mismatch/max"] <= 1e-5 and r["mismatch/n_tokens"] > 0, r
            assert r["staleness/max"] == 0.0 and r["version"] == r["step"]
            assert r["moe/route_agreement"] == 1.0, r
            assert r["moe/mismatch_live/max"] <= 1e-5, r

        assert_server_serves_the_checkpoint(server, moe_model, run_dir(tmp_path), STEPS, tmp_path / "final")
    finally:
        server.stop()

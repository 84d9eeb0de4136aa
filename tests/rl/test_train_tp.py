"""`tandem train` with a tensor-parallel trainer (`actor.backend=archon:t2`): the RL loop runs with
distributed weight sync, and the servers' log-probs of what they generated equal the trainer's
(so the weights the servers got from the TP shards are the trainer's model)."""

from __future__ import annotations

import subprocess

import pytest

from tandem.models.tiny import init_model
from tests.rl.common import TANDEM, rl_rows, write_config

pytestmark = pytest.mark.slow


def test_rl_loop_with_tp_trainer_and_distributed_sync(tmp_path):
    model = init_model(tmp_path / "untied", preset="tiny-untied", seed=0)
    cfg = write_config(tmp_path, model, actor={"backend": "archon:t2"},
                       rollout={"backend": "tandem:d1", "max_head_offpolicyness": 0},
                       train={"total_steps": 2, "weight_sync": "distributed"})
    proc = subprocess.run([TANDEM, "train", str(cfg)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = rl_rows(tmp_path)
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        # Synchronous: the first minibatch's ratio is exactly 1; the servers, updated after step 1
        # from the TP trainer's export, score their tokens as the trainer does.
        assert r["ppo/ratio_max"] == 1.0 and r["version"] == r["step"]
        assert r["mismatch/n_tokens"] > 0 and r["mismatch/max"] <= 1e-5, r["mismatch/max"]

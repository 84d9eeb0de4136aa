"""`tandem train` with a pipeline-parallel trainer (archon:p2): the RL loop runs, and after every
distributed weight update the servers hold exactly the trainer's model (their log-probs of the
sampled tokens equal the trainer's, and per-tensor checksums agree)."""

from __future__ import annotations

import subprocess

import pytest

from tandem.models.tiny import init_model
from tests.rl.common import TANDEM, rl_rows, write_config

pytestmark = pytest.mark.slow


def test_p2_zbv_tied_rl_loop_servers_match_trainer(tmp_path):
    """ZBV puts the first and the last stage on rank 0 and the tied embedding has a copy in each;
    the export sends it once, and the servers' log-probs equal the trainer's."""
    model = init_model(tmp_path / "model", preset="tiny", seed=0, overrides={"num_hidden_layers": 4})
    cfg = write_config(
        tmp_path, model,
        actor={"backend": "archon:p2", "parallelize": {"pp_schedule": "ZBV"}},
        rollout={"backend": "tandem:d1", "max_head_offpolicyness": 0},
        train={"total_steps": 2, "weight_sync": "distributed", "verify_weights": True},
    )
    proc = subprocess.run([TANDEM, "train", str(cfg)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = rl_rows(tmp_path)
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["ppo/ratio_max"] == 1.0
        assert r["mismatch/max"] <= 1e-5, r["mismatch/max"]
        assert r["mismatch/n_tokens"] > 0
        assert r["version"] == r["step"]

"""`tandem sft` and `tandem train` with Ulysses context parallelism, as a user runs them.

(`tandem sft` under d2c2 is in `tests/rl/test_parallel_sft.py` with the other layouts.)
- `tandem train` with archon:c2 in the synchronous setting with a constant advantage (so every
  step really moves the weights): after each distributed weight sync the servers' log-probs of
  the tokens they sampled equal the CP trainer's recomputed ones.
"""

from __future__ import annotations

import subprocess

import pytest

from tests.rl.common import TANDEM, rl_rows, write_config

pytestmark = pytest.mark.slow

def test_train_c2_servers_follow_the_cp_trainer(tmp_path, model_dir):
    cfg = write_config(
        tmp_path, model_dir, actor={"backend": "archon:c2", "optimizer": {"lr": 1e-2}},
        rollout={"max_head_offpolicyness": 0}, train={"total_steps": 3},
        # Every token gets advantage 1 (no baseline): the weights move at every step, so each
        # step's servers run weights that only a working sync can have given them.
        algo={"reward": {"reward_bias": 1.0}, "advantage": {"mean_level": "none", "std_level": "none"}},
    )
    proc = subprocess.run([TANDEM, "train", str(cfg)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = rl_rows(tmp_path)
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert r["train/grad_norm"] > 0 and r["version"] == r["step"]
        assert r["mismatch/n_tokens"] > 0 and r["mismatch/max"] <= 1e-5, r
    print(f"\n[tandem train c2] grad norms {[round(r['train/grad_norm'], 4) for r in rows]}, "
          f"server/trainer max |logprob diff| {max(r['mismatch/max'] for r in rows):.2e}")

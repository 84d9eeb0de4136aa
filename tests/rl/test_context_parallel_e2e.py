"""`tandem sft` and `tandem train` with Ulysses context parallelism, as a user runs them.

- `tandem sft` with archon:d2c2 (4 trainer ranks) against archon:d1 on an untied 4-layer tiny
  Qwen3: per-step loss and grad norm, and the saved HF weights.
- `tandem train` with archon:c2 in the synchronous setting with a constant advantage (so every
  step really moves the weights): after each distributed weight sync the servers' log-probs of
  the tokens they sampled equal the CP trainer's recomputed ones.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tandem.models.hf_checkpoint import iter_hf_tensors
from tests.rl.common import TANDEM, rl_rows, run_dir, write_config
from tests.train.cp_workers import untied_four_layer_model
from tests.train.helpers import max_param_diff, rel_diff

pytestmark = pytest.mark.slow

# Adam eps 1e-6 instead of 1e-8: see tests/train/cp_workers.py (round-off-sized gradient entries).
OPTIMIZER = {"lr": 1e-3, "eps": 1e-6}


def _sft(tmp_path: Path, model: Path, backend: str) -> tuple[list[dict], dict]:
    tmp_path.mkdir()
    cfg = write_config(tmp_path, model, actor={"backend": backend, "optimizer": OPTIMIZER},
                       rollout={"backend": "tandem:d1"}, sft={"steps": 3, "batch_size": 8})
    proc = subprocess.run([TANDEM, "sft", str(cfg)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (run_dir(tmp_path) / "sft-metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "loss" in r], dict(iter_hf_tensors(run_dir(tmp_path) / "sft"))


def test_sft_d2c2_equals_d1(tmp_path):
    model = untied_four_layer_model(tmp_path / "qwen3-4l-untied")
    ref_rows, ref_weights = _sft(tmp_path / "d1", model, "archon:d1")
    rows, weights = _sft(tmp_path / "d2c2", model, "archon:d2c2")
    assert [r["step"] for r in rows] == [1, 2, 3] and [r["n_loss_tokens"] for r in rows] == [
        r["n_loss_tokens"] for r in ref_rows]
    loss = max(rel_diff(a["loss"], b["loss"]) for a, b in zip(rows, ref_rows, strict=True))
    gnorm = max(rel_diff(a["grad_norm"], b["grad_norm"]) for a, b in zip(rows, ref_rows, strict=True))
    weight = max_param_diff(weights, ref_weights)
    print(f"\n[tandem sft d2c2 vs d1] max rel diff: loss {loss:.2e}, grad norm {gnorm:.2e}; "
          f"saved weights max |diff| {weight:.2e}")
    assert loss <= 1e-5 and gnorm <= 1e-4 and weight <= 1e-5
    assert ref_rows[0]["loss"] != ref_rows[-1]["loss"]


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

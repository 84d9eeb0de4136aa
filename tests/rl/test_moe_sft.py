"""`tandem sft` of a tiny untied Qwen3-MoE under expert-parallel layouts equals `archon:d1`, as a
user runs it: per-step loss within 1e-5 and grad norm within 1e-4 (relative), and the saved HF
weights within 1e-5 (3 steps of 8 sequences; 8 experts, top-2, one dense layer among the MoE ones).

Same settings as tests/rl/test_parallel_sft.py (4 micro-batches per data-parallel rank, Adam eps
1e-6; see there why).
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tandem.models.hf_checkpoint import iter_hf_tensors
from tandem.models.tiny import init_model
from tests.rl.common import TANDEM, run_dir, write_config
from tests.train.helpers import max_param_diff, rel_diff

pytestmark = pytest.mark.slow
OPTIMIZER = {"lr": 1e-3, "eps": 1e-6}
LAYOUTS = {  # name -> actor.backend
    "d2e2": "archon:d2e2",
    "hybrid-d2|e2": "archon:(attn:d2|ffn:e2)",
    "hybrid-d2t2|e2t2": "archon:(attn:d2t2|ffn:e2t2)",
    "d2t2e2": "archon:d2t2e2",
    "d2p2e2": "archon:d2p2e2",
    "d4e2": "archon:d4e2",
}


def _sft(tmp_path: Path, model: Path, backend: str) -> tuple[list[dict], dict]:
    tmp_path.mkdir()
    cfg = write_config(tmp_path, model, actor={"backend": backend, "optimizer": OPTIMIZER, "mb": {"n_mbs": 4}},
                       rollout={"backend": "tandem:d1"}, sft={"steps": 3, "batch_size": 8})
    proc = subprocess.run([TANDEM, "sft", str(cfg)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (run_dir(tmp_path) / "sft-metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "loss" in r], dict(iter_hf_tensors(run_dir(tmp_path) / "sft"))


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return init_model(tmp_path_factory.mktemp("m") / "qwen3-moe-untied", arch="qwen3_moe", preset="tiny", seed=0,
                      overrides={"num_hidden_layers": 3, "mlp_only_layers": [1], "tie_word_embeddings": False})


@pytest.fixture(scope="module")
def reference(tmp_path_factory, model):
    return _sft(tmp_path_factory.mktemp("ref") / "d1", model, "archon:d1")


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_moe_sft_layout_equals_d1(tmp_path, model, reference, layout):
    ref_rows, ref_weights = reference
    rows, weights = _sft(tmp_path / layout, model, LAYOUTS[layout])
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert [r["n_loss_tokens"] for r in rows] == [r["n_loss_tokens"] for r in ref_rows]
    loss = max(rel_diff(a["loss"], b["loss"]) for a, b in zip(rows, ref_rows, strict=True))
    gnorm = max(rel_diff(a["grad_norm"], b["grad_norm"]) for a, b in zip(rows, ref_rows, strict=True))
    weight = max_param_diff(weights, ref_weights)
    print(f"\n[tandem sft {layout} vs d1] max rel diff: loss {loss:.2e}, grad norm {gnorm:.2e}; "
          f"saved weights max |diff| {weight:.2e}")
    assert set(weights) == set(ref_weights)
    assert loss <= 1e-5 and gnorm <= 1e-4 and weight <= 1e-5
    assert ref_rows[0]["loss"] != ref_rows[-1]["loss"]  # it trains

"""`tandem sft` under every model-parallel layout equals `archon:d1`, as a user runs it: per-step
loss within 1e-5 and grad norm within 1e-4 (relative), and the saved HF weights within 1e-5, on
an untied 4-layer tiny Qwen3 (3 steps of 8 sequences).

Every run uses 4 micro-batches per data-parallel rank (the pipeline needs at least as many as
its stages, and equal plans keep the comparison about the layout) and Adam eps 1e-6: with the
default 1e-8 a few gradient entries that are pure round-off (~1e-9) are divided by ~1e-8, so any
change of summation order moves their weights by up to the learning rate (d2 alone is 1.2e-4
from d1 then; the losses and gradients agree either way).
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
LAYOUTS = {  # name -> (actor.backend, actor.parallelize)
    "d2": ("archon:d2", {}),
    "t2": ("archon:t2", {}),
    "p2-1F1B": ("archon:p2", {"pp_schedule": "1F1B"}),
    "p2-I1F1B": ("archon:p2", {"pp_schedule": "I1F1B"}),
    "p2-IZB": ("archon:p2", {"pp_schedule": "IZB"}),
    "p2-ZBV": ("archon:p2", {"pp_schedule": "ZBV"}),
    "c2": ("archon:c2", {}),
    "d2t2": ("archon:d2t2", {}),
    "p2t2": ("archon:p2t2", {}),
    "d2c2": ("archon:d2c2", {}),
}


def _sft(tmp_path: Path, model: Path, backend: str, parallelize: dict) -> tuple[list[dict], dict]:
    tmp_path.mkdir()
    cfg = write_config(tmp_path, model, actor={"backend": backend, "optimizer": OPTIMIZER,
                                               "mb": {"n_mbs": 4}, "parallelize": parallelize},
                       rollout={"backend": "tandem:d1"}, sft={"steps": 3, "batch_size": 8})
    proc = subprocess.run([TANDEM, "sft", str(cfg)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (run_dir(tmp_path) / "sft-metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "loss" in r], dict(iter_hf_tensors(run_dir(tmp_path) / "sft"))


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return init_model(tmp_path_factory.mktemp("m") / "qwen3-4l-untied", preset="tiny", seed=0,
                      overrides={"num_hidden_layers": 4, "tie_word_embeddings": False})


@pytest.fixture(scope="module")
def reference(tmp_path_factory, model):
    return _sft(tmp_path_factory.mktemp("ref") / "d1", model, "archon:d1", {})


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_sft_layout_equals_d1(tmp_path, model, reference, layout):
    ref_rows, ref_weights = reference
    rows, weights = _sft(tmp_path / layout, model, *LAYOUTS[layout])
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

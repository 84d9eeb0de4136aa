"""`tandem sft` with LoRA on a tiny untied Qwen3-MoE at `archon:d2e2` equals `archon:d1`, as a user
runs it (issue 46's acceptance line): per-step loss within 1e-5 and grad norm within 1e-4
(relative), the saved PEFT adapter within 1e-5; the adapters sit on the attention and the one dense
MLP, the experts take none. 3 steps of 8 sequences, 4 micro-batches per data-parallel rank, Adam eps
1e-6 (tests/rl/test_parallel_sft.py says why)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tandem.models.common.lora import read_adapter
from tandem.models.tiny import init_model
from tests.rl.common import TANDEM, run_dir, write_config
from tests.train.helpers import max_param_diff, rel_diff

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return init_model(tmp_path_factory.mktemp("m") / "qwen3-moe-untied", arch="qwen3_moe", preset="tiny", seed=0,
                      overrides={"num_hidden_layers": 3, "mlp_only_layers": [1], "tie_word_embeddings": False})


def lora_sft(tmp_path: Path, model: Path, backend: str) -> tuple[list[dict], dict]:
    """(metrics rows with a loss, the saved adapter's tensors) of 3 LoRA SFT steps under `backend`."""
    tmp_path.mkdir()
    cfg = write_config(tmp_path, model, actor={"backend": backend, "optimizer": {"lr": 1e-3, "eps": 1e-6},
                                               "mb": {"n_mbs": 4}, "lora": {"rank": 4, "alpha": 8.0}},
                       rollout={"backend": "tandem:d1"}, sft={"steps": 3, "batch_size": 8}, task={"eval_size": 0})
    proc = subprocess.run([TANDEM, "sft", str(cfg)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (run_dir(tmp_path) / "sft-metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "loss" in r], read_adapter(run_dir(tmp_path) / "sft")


def test_lora_sft_at_d2e2_equals_d1(tmp_path, model):
    ref_rows, ref_adapter = lora_sft(tmp_path / "d1", model, "archon:d1")
    rows, adapter = lora_sft(tmp_path / "d2e2", model, "archon:d2e2")
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert [r["n_loss_tokens"] for r in rows] == [r["n_loss_tokens"] for r in ref_rows]
    loss = max(rel_diff(a["loss"], b["loss"]) for a, b in zip(rows, ref_rows, strict=True))
    gnorm = max(rel_diff(a["grad_norm"], b["grad_norm"]) for a, b in zip(rows, ref_rows, strict=True))
    weights = max_param_diff(adapter, ref_adapter)
    print(f"\n[tandem sft LoRA archon:d2e2 vs d1] max rel diff: loss {loss:.2e}, grad norm {gnorm:.2e}; "
          f"saved adapter max |diff| {weights:.2e}")
    assert loss <= 1e-5 and gnorm <= 1e-4 and weights <= 1e-5
    assert ref_rows[0]["loss"] != ref_rows[-1]["loss"]  # it trains
    # Attention q/k/v/o in each of the 3 layers and the dense layer's MLP, A and B each; no expert.
    assert len(adapter) == (3 * 4 + 3) * 2 and not any(".experts." in n for n in adapter)
    assert sum(".mlp." in n for n in adapter) == 3 * 2 and all("layers.1.mlp" in n for n in adapter if ".mlp." in n)

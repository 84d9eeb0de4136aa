"""What the `tandem sft`-under-a-layout tests share: one run as a user makes it, and the comparison
with `archon:d1` (per-step loss within 1e-5 and grad norm within 1e-4 relative, saved weights
within 1e-5). 4 micro-batches per data-parallel rank and Adam eps 1e-6: see
tests/rl/test_parallel_sft.py for why."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from tandem.models.hf_checkpoint import iter_hf_tensors
from tests.rl.common import TANDEM, run_dir, write_config
from tests.train.helpers import max_param_diff, rel_diff

OPTIMIZER = {"lr": 1e-3, "eps": 1e-6}
SftRun = tuple[list[dict], dict]  # (metrics rows with a loss, saved HF tensors)


def sft_run(tmp_path: Path, model: Path, backend: str, parallelize: dict | None = None) -> SftRun:
    """3 steps of 8 sequences of `tandem sft` under `backend` in a fresh `tmp_path`, without the
    final evaluation (task.eval_size=0: no inference server is started for it)."""
    tmp_path.mkdir()
    cfg = write_config(tmp_path, model, actor={"backend": backend, "optimizer": OPTIMIZER,
                                               "mb": {"n_mbs": 4}, "parallelize": parallelize or {}},
                       rollout={"backend": "tandem:d1"}, sft={"steps": 3, "batch_size": 8}, task={"eval_size": 0})
    proc = subprocess.run([TANDEM, "sft", str(cfg)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "; not evaluated" in proc.stdout and not list((run_dir(tmp_path) / "logs").glob("sft-eval*")), proc.stdout
    rows = [json.loads(line) for line in (run_dir(tmp_path) / "sft-metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "loss" in r], dict(iter_hf_tensors(run_dir(tmp_path) / "sft"))


def assert_equals_d1(layout: str, run: SftRun, reference: SftRun) -> None:
    """`run` trained like the `archon:d1` `reference` (and the reference trained at all)."""
    (rows, weights), (ref_rows, ref_weights) = run, reference
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

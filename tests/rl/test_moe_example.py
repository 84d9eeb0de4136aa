"""examples/moe.yaml runs as written (only the model, the output root and the length changed):
experts split over two trainer ranks, two servers returning routes, r3, verified distributed
updates, an eval at the end."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tandem.models.tiny import init_model
from tests.rl.common import TANDEM

pytestmark = pytest.mark.slow
EXAMPLE = Path(__file__).parents[2] / "examples" / "moe.yaml"


def test_the_moe_example_runs(tmp_path):
    model = init_model(tmp_path / "moe-tiny", arch="qwen3_moe", preset="tiny", seed=0)
    proc = subprocess.run(
        [TANDEM, "train", str(EXAMPLE), f"actor.path={model}", f"experiment.fileroot={tmp_path / 'runs'}",
         "train.total_steps=3", "train.eval_every=3", "task.eval_size=16", "stats.progress=false"],
        capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [json.loads(line) for line in (tmp_path / "runs" / "moe" / "run" / "metrics.jsonl").read_text().splitlines()]
    rl = [r for r in rows if r["phase"] == "rl" and r["step"] > 0]
    assert [r["step"] for r in rl] == [1, 2, 3]
    assert all(r["moe/route_agreement"] == 1.0 and r["moe/route_pairs"] > 0 for r in rl), rl
    assert any("eval/accuracy" in r for r in rows)
    assert "eval accuracy:" in proc.stdout

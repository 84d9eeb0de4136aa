"""The Archon tutorial's example config, converted by `tandem convert-config` with the tutorial's
`+actor.archon.ac_debug=True`, trains: `tandem sft` from the written file, scaled down to this
machine only by command-line overrides (CPU, the tiny model, two ranks instead of 16, one local
server slot, two steps). Its activation-checkpointing debug log is checked against the hand count
of a Qwen3 block: 7 projections (q, k, v, o, gate, up, down) and one attention, whose outputs
op-level checkpointing keeps."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import yaml

from tests.rl.common import TANDEM

EXAMPLE = Path(__file__).parents[1] / "config" / "fixtures" / "archon_qwen3_8b.yaml"
SCALED_DOWN = ["experiment.device=cpu", "scheduler.type=local", "actor.backend=archon:d2", "rollout.backend=tandem:d1",
               "sft.steps=2", "sft.batch_size=8", "task.eval_size=0", "stats.progress=false"]


def test_the_documents_example_converts_and_trains(tmp_path, model_dir):
    converted = tmp_path / "converted.yaml"
    proc = subprocess.run([TANDEM, "convert-config", str(EXAMPLE), "+actor.archon.ac_debug=True", "-o", str(converted)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    print("\n" + proc.stdout)
    proc = subprocess.run([TANDEM, "sft", str(converted), f"actor.path={model_dir}",
                           f"experiment.fileroot={tmp_path / 'runs'}", *SCALED_DOWN],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = tmp_path / "runs" / "archon-gsm8k-grpo" / "trial-0"  # the example's experiment_name / trial_name
    recorded = yaml.safe_load((run / "sft-config.yaml").read_text())
    p = recorded["actor"]["parallelize"]
    assert (p["activation_checkpoint"], p["ac_selective"], p["compile"], p["ac_debug"]) == ("selective", "op", False, True)
    assert recorded["actor"]["dtype"] == "bfloat16"  # AReaL's default, written by the converter
    rows = [json.loads(line) for line in (run / "sft-metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == [1, 2]
    for rank in (0, 1):
        log = (run / "logs" / f"actor-rank{rank}.log").read_text()
        lines = re.findall(r"ac_debug .*", log)
        print(f"[actor-rank{rank}]", *lines, sep="\n  ")
        assert "ac_debug op-level selective checkpointing: 2 of 2 blocks recomputed in backward (layers.0, layers.1)" \
            in lines
        for block in ("layers.0", "layers.1"):
            forward = [x for x in lines if x.startswith(f"ac_debug {block} (op-level selective) forward: ")]
            backward = [x for x in lines if x.startswith(f"ac_debug {block} (op-level selective) backward: ")]
            assert forward and backward, lines
            assert all(re.search(r"forward: saved the outputs of 8 ops \(aten\.mm x7, aten\._scaled_dot_product_\w+ x1\)"
                                 r"; \d+ ops left to recompute", x) for x in forward)
            assert all(re.search(r"backward: recomputed \d+ ops", x) and "aten.mm" not in x for x in backward)

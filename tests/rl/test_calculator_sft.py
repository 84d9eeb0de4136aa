"""`tandem sft` on the calculator task, as a user runs it: whole reference conversations go to the
trainer with the loss on both assistant turns, and the eval runs the task's agent through the agent proxy."""

from __future__ import annotations

import json
import subprocess

import pytest
from transformers import AutoTokenizer

from tandem.data.tasks import get_task, sft_example
from tandem.models.tiny import init_model
from tests.rl.common import TANDEM, run_dir, write_config

pytestmark = pytest.mark.slow
OPTIONS = {"difficulty": "add2", "terms": 3, "instruction": False, "teacher_slip": 0.5}


def test_sft_trains_on_conversations_and_evaluates_with_the_tool_loop(tmp_path):
    model = init_model(tmp_path / "model", preset="tiny", seed=0)
    cfg = write_config(tmp_path, model, experiment={"seed": 3}, actor={"backend": "archon:d1"},
                       rollout={"backend": "tandem:d1"},
                       gen={"max_new_tokens": 8},
                       task={"name": "calculator", "options": OPTIONS, "train_size": 16, "eval_size": 3},
                       sft={"steps": 2, "batch_size": 4, "output": str(tmp_path / "sft-out")})
    proc = subprocess.run([TANDEM, "sft", str(cfg)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (run_dir(tmp_path) / "sft-metrics.jsonl").read_text().splitlines()]
    steps, (evals,) = [r for r in rows if "loss" in r], [r for r in rows if "eval/accuracy" in r]
    assert [r["step"] for r in steps] == [1, 2]  # sft.steps
    assert (tmp_path / "sft-out" / "config.json").is_file() and not (run_dir(tmp_path) / "sft").exists()  # sft.output
    # Step 1 trained on the first 4 conversations: every token of both assistant turns, nothing else.
    tokenizer, task = AutoTokenizer.from_pretrained(model), get_task("calculator", **OPTIONS)
    first = [sft_example(item, tokenizer, task) for item in task.generate(4, seed=3)]
    assert steps[0]["n_loss_tokens"] == sum(sum(e["loss_mask"]) for e in first)
    assert steps[0]["n_tokens"] == sum(len(e["input_ids"]) for e in first)
    # The eval runs the task's agent through the proxy: a random model writes no tool call in 8
    # tokens, so each run is one call, answered (wrongly) without the tool.
    assert evals["eval/n"] == 3 and evals["eval/failed"] == 0
    assert evals["eval/calls"] == 1.0 and evals["eval/accuracy"] == 0.0

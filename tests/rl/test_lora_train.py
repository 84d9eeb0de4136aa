"""`tandem train` with LoRA to `tandem serve`, starting from a trained adapter (`actor.lora.path`):
the servers start from `actor.path`, the base, so the run must send its adapter before the first
rollout, or version 0's samples come from another policy than the trainer's version 0."""

from __future__ import annotations

import subprocess

import peft
import pytest
import torch
import transformers

from tests.rl.common import TANDEM, rl_rows, write_config

pytestmark = pytest.mark.slow


def test_a_run_that_starts_from_an_adapter_serves_it_from_version_0(tmp_path, model_dir):
    torch.manual_seed(0)
    base = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = peft.get_peft_model(base, peft.LoraConfig(r=8, lora_alpha=16, target_modules=[
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
    with torch.no_grad():  # a trained adapter: B away from PEFT's zero start
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, 0.5)
    model.save_pretrained(tmp_path / "adapter")
    cfg = write_config(tmp_path, model_dir, actor={"backend": "archon:d1", "lora": {
                           "rank": 8, "alpha": 16, "path": str(tmp_path / "adapter")}},
                       rollout={"backend": "tandem:d1", "max_head_offpolicyness": 0},
                       train={"total_steps": 1, "weight_sync": "disk"})
    proc = subprocess.run([TANDEM, "train", str(cfg)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    [row] = rl_rows(tmp_path)
    # step 1 trains on version 0's samples: the servers' logprobs are the trainer's (base + adapter)
    assert row["mismatch/n_tokens"] > 0 and row["mismatch/max"] <= 1e-5, row["mismatch/max"]

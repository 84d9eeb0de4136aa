"""`tandem train` with LoRA (`actor.lora`), as a user runs it: at staleness 0 in fp32 the server's
logprobs equal the trainer's after every adapter update (`mismatch/max` <= 1e-5), every update is
verified (`train.verify_weights`: the adapter's checksums), each moves the adapter alone (`sync/mb`
a small fraction of the whole model), and the checkpoint holds the PEFT adapter; a merged export of
it (`tandem export-merged`) equals what the server holds. On a tiny Qwen3-MoE at `archon:d2e2`
with rollout routing replay (r3), where the attention takes adapters and the experts do not. A run
that starts from an adapter (PEFT's own, or `tandem sft`'s) serves it from version 0: the servers
start from `actor.path`, the base, so the run sends its adapter before the first rollout."""

from __future__ import annotations

import json
import subprocess

import peft
import pytest
import torch
import transformers

from tandem.models.common.lora import ADAPTER_CONFIG
from tandem.models.hf_checkpoint import iter_hf_tensors
from tandem.models.tiny import init_model
from tests.inference.server_utils import ServerProcess, request
from tests.rl.common import TANDEM, rl_rows, run_dir, write_config
from tests.weights.common import expected_checksums

pytestmark = pytest.mark.slow
STEPS = 2
LORA = {"rank": 4, "alpha": 8.0}


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe"])
def test_lora_rl_loop(tmp_path, arch):
    model = init_model(tmp_path / "model", arch=arch, preset="tiny", seed=0)
    server = ServerProcess(model, tmp_path)
    try:
        actor = {"backend": "archon:d2", "lora": LORA, "optimizer": {"lr": 1e-2}}
        if arch == "qwen3_moe":
            actor |= {"backend": "archon:d2e2", "router_replay": "r3"}
        cfg = write_config(tmp_path, model, actor=actor,
                           rollout={"backend": "tandem:d1", "servers": [server.url], "max_head_offpolicyness": 0},
                           train={"total_steps": STEPS, "weight_sync": "distributed", "verify_weights": True,
                                  "save_every": STEPS})
        proc = subprocess.run([TANDEM, "train", str(cfg)], capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-4000:]
        log = (run_dir(tmp_path) / "logs" / "actor-rank0.log").read_text()
        assert "LoRA rank 4, alpha 8" in log, log[-2000:]
        whole_mb = sum(t.numel() * 4 for _, t in iter_hf_tensors(model)) / 1e6
        rows = rl_rows(tmp_path)
        assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
        for r in rows:
            assert r["mismatch/max"] <= 1e-5 and r["mismatch/n_tokens"] > 0, r
            assert r["staleness/max"] == 0.0 and r["version"] == r["step"], r
            assert 0 < r["sync/mb"] * 4 < whole_mb, (r["sync/mb"], whole_mb)
            if arch == "qwen3_moe":
                assert r["moe/route_agreement"] == 1.0, r
        adapter = run_dir(tmp_path) / "checkpoints" / f"step{STEPS:08d}" / "trainer" / "adapter"
        assert (adapter / ADAPTER_CONFIG).is_file(), sorted(p.name for p in adapter.parent.iterdir())
        merged = tmp_path / "merged"
        done = subprocess.run([TANDEM, "export-merged", str(model), str(adapter), str(merged)], capture_output=True,
                              text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        status, served = request(server.url, "POST", "/get_weights_checksum", {})
        assert status == 200
        want = expected_checksums(dict(iter_hf_tensors(merged)))
        assert {n: served["checksums"][n] for n in want} == want
    finally:
        server.stop()


def test_lora_sft_then_train_from_its_adapter(tmp_path):
    """`tandem sft` with LoRA saves the PEFT adapter and evaluates it merged; `tandem train` starts
    from that adapter (`actor.lora.path`): the servers serve it from the first episode on, and the
    run's first eval equals the SFT's."""
    model = init_model(tmp_path / "model", arch="qwen3", preset="tiny", seed=0)
    lora = {**LORA, "rank": 4}
    cfg = write_config(tmp_path, model, actor={"backend": "archon:d1", "lora": lora, "optimizer": {"lr": 1e-2}},
                       rollout={"backend": "tandem:d1"}, sft={"steps": 3, "batch_size": 8, "output": str(tmp_path / "sft")},
                       task={"eval_size": 8})
    proc = subprocess.run([TANDEM, "sft", str(cfg)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "sft" / ADAPTER_CONFIG).is_file() and (tmp_path / "sft-merged" / "config.json").is_file()
    lines = (run_dir(tmp_path) / "sft-metrics.jsonl").read_text().splitlines()
    sft_rows = [r for r in map(json.loads, lines) if "eval/accuracy" in r]
    assert sft_rows, "the SFT evaluated its adapter"
    cfg = write_config(tmp_path, model, actor={"backend": "archon:d1", "optimizer": {"lr": 1e-2},
                                               "lora": {**lora, "path": str(tmp_path / "sft")}},
                       rollout={"backend": "tandem:d1", "max_head_offpolicyness": 0}, task={"eval_size": 8},
                       train={"total_steps": 1, "eval_every": 1, "overwrite": True})
    proc = subprocess.run([TANDEM, "train", str(cfg)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = map(json.loads, (run_dir(tmp_path) / "metrics.jsonl").read_text().splitlines())
    evals = [r for r in rows if r["phase"] == "rl" and "eval/accuracy" in r]
    # The servers start from the base: the run's first update (version 0) gives them the adapter, so
    # the first step's episodes are the adapter's (staleness 0, fp32: the trainer's logprobs agree).
    step1 = rl_rows(tmp_path)[0]
    assert step1["mismatch/max"] <= 1e-5 and step1["mismatch/n_tokens"] > 0, step1
    first, sft_eval = evals[0], sft_rows[-1]
    assert first["step"] == 0, evals  # before any RL step: the base with the SFT's adapter
    assert (first["eval/accuracy"], first["eval/response_len"]) == (sft_eval["eval/accuracy"],
                                                                    sft_eval["eval/response_len"]), (first, sft_eval)


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

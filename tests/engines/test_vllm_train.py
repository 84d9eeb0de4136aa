"""`tandem train` with `rollout.backend=vllm:d1`: Tandem starts the vLLM server itself (the
interpreter `rollout.vllm.python`) and moves the trainer's weights to it through disk updates."""

from __future__ import annotations

import subprocess

from tests.rl.common import TANDEM, rl_rows, run_dir, write_config


def test_train_with_a_launched_vllm_server_and_disk_sync(tmp_path, small_model, vllm_python_path):
    cfg = write_config(tmp_path, small_model, actor={"backend": "archon:d1"},
                       rollout={"backend": "vllm:d1", "server_args": [],
                                "vllm": {"python": vllm_python_path, "threads": 1, "max_model_len": 512}},
                       train={"total_steps": 2, "weight_sync": "disk"})
    proc = subprocess.run([TANDEM, "train", str(cfg)], capture_output=True, text=True, timeout=480)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert [r["version"] for r in rl_rows(tmp_path)] == [1.0, 2.0]
    weights = run_dir(tmp_path) / "weights"
    kept = sorted(p for p in weights.iterdir() if p.name.startswith("v"))
    # the newest update stays, with the tied output head written out for vLLM's reload
    assert kept and (kept[-1] / "lm_head.safetensors").is_file(), kept
    log = (run_dir(tmp_path) / "logs" / "rollout-0.log")
    text = log.read_text() if log.is_file() else ""
    assert "vllm.entrypoints.openai.api_server" in text and text.count("/collective_rpc") >= 2, text[-2000:]

"""`tandem train` with `rollout.backend=vllm:d1`: Tandem starts the vLLM server itself (the
interpreter `rollout.vllm.python`, with Tandem's worker extension) and moves the trainer's weights
to it after every step, from disk or over a transfer group (staged in the worker, then committed).
The server runs compiled (vLLM's default and faster mode), as `tandem train` starts it by default."""

from __future__ import annotations

import subprocess

import pytest

from tests.rl.common import TANDEM, rl_rows, run_dir, write_config


@pytest.mark.parametrize("sync", ["disk", "distributed"])
def test_train_with_a_launched_vllm_server(tmp_path, small_model, vllm_python_path, sync):
    cfg = write_config(tmp_path, small_model, actor={"backend": "archon:d1"},
                       rollout={"backend": "vllm:d1", "server_args": [],
                                "vllm": {"python": vllm_python_path, "threads": 1, "max_model_len": 512}},
                       train={"total_steps": 2, "weight_sync": sync})
    proc = subprocess.run([TANDEM, "train", str(cfg)], capture_output=True, text=True, timeout=480)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = rl_rows(tmp_path)
    assert [r["version"] for r in rows] == [1.0, 2.0]
    # vLLM's behaviour logprobs agree with the trainer's recompute at the version that produced
    # them (step 2 trains on episodes generated after the first update)
    assert all(abs(r["ppo/behave_approx_kl"]) < 1e-6 for r in rows), [r["ppo/behave_approx_kl"] for r in rows]
    if sync == "disk":
        weights = run_dir(tmp_path) / "weights"
        kept = sorted(p for p in weights.iterdir() if p.name.startswith("v"))
        # the newest update stays, with the tied output head written out for vLLM's reload
        assert kept and (kept[-1] / "lm_head.safetensors").is_file(), kept
    log = (run_dir(tmp_path) / "logs" / "rollout-0.log")
    text = log.read_text() if log.is_file() else ""
    assert "vllm.entrypoints.openai.api_server" in text and "TandemWorkerExtension" in text, text[-2000:]
    # compiled, vLLM's default (rollout.vllm.enforce_eager=false): its engine says so and compiles at start-up
    assert "enforce_eager=False" in text and "Warming up model for the compilation" in text, text[-2000:]
    # disk: stage + commit per update; distributed: join, buckets, commit
    assert text.count("/collective_rpc") >= (4 if sync == "disk" else 6), text[-2000:]

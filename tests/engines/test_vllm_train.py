"""`tandem train` with `rollout.backend=vllm:d1`: Tandem starts the vLLM server itself (the
interpreter `rollout.vllm.python`, with Tandem's worker extension) and moves the trainer's weights
to it after every step, from disk or over a transfer group (staged in the worker, then committed).
The server runs compiled (vLLM's default and faster mode), as `tandem train` starts it by default."""

from __future__ import annotations

import subprocess

import peft
import pytest
import torch
import transformers

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


def test_train_lora_sends_the_adapter_to_a_launched_vllm_server(tmp_path, small_model, vllm_python_path):
    """`actor.lora` with `train.weight_sync=disk`: the server runs vLLM's LoRA support and each
    update (version 0 before the first rollout, then one per step) loads the trainer's PEFT adapter
    directory under the adapter's name; at staleness 0 every step trains on tokens vLLM sampled with
    the adapter of the trainer's current version (each token's logprob within 1e-5 of the trainer's
    recompute), and the adapter moved the policy far from the base (peft on transformers, the
    oracle; every token's advantage is 1 and the rate high, so each step moves it), so a server
    serving the base or a stale adapter would fail the first check."""
    cfg = write_config(tmp_path, small_model, actor={"backend": "archon:d1", "lora": {"rank": 8, "alpha": 16},
                                                     "optimizer": {"lr": 0.05}},
                       rollout={"backend": "vllm:d1", "server_args": [], "max_head_offpolicyness": 0,
                                "vllm": {"python": vllm_python_path, "threads": 1, "max_model_len": 512}},
                       train={"total_steps": 3, "weight_sync": "disk"},
                       # every token's advantage 1: each step moves the adapter (no group without signal)
                       algo={"reward": {"reward_bias": 1.0}, "advantage": {"mean_level": "none", "std_level": "none"}})
    proc = subprocess.run([TANDEM, "train", str(cfg)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = rl_rows(tmp_path)
    assert [r["version"] for r in rows] == [1.0, 2.0, 3.0]
    kl, worst = [r["ppo/behave_approx_kl"] for r in rows], [r["mismatch/max"] for r in rows]
    print(f"per step: behave_approx_kl {kl}, max |vLLM - trainer| logprob {worst}, "
          f"tokens {[r['mismatch/n_tokens'] for r in rows]}, sync/mb {[r['sync/mb'] for r in rows]}, "
          f"sync/seconds {[round(r['sync/seconds'], 3) for r in rows]}")
    assert all(abs(k) < 1e-6 for k in kl) and all(w < 1e-5 for w in worst), (kl, worst)
    # every token trained on was sampled at the trainer's version (staleness 0, vLLM's labels)
    assert all(r["mismatch/current_n_tokens"] == r["mismatch/n_tokens"] > 0 for r in rows)
    weights = run_dir(tmp_path) / "weights"
    kept = sorted(p for p in weights.iterdir() if p.name.startswith("v"))
    assert [p.name for p in kept] == ["v00000003"], kept  # the newest adapter; older ones deleted
    assert sorted(f.name for f in kept[0].iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    assert all(r["sync/mb"] < 1.0 for r in rows)  # the adapter alone (0.5 MB), not the 12 MB model
    base = transformers.AutoModelForCausalLM.from_pretrained(small_model, dtype=torch.float32).eval()
    ids = torch.tensor([[11, 12, 13, 14, 15, 16, 17, 18]])
    with torch.no_grad():
        before = torch.log_softmax(base(input_ids=ids).logits, -1)
        after = torch.log_softmax(peft.PeftModel.from_pretrained(base, kept[0])(input_ids=ids).logits, -1)
    moved = (after - before).abs().max().item()
    print(f"the trained adapter moves the base's logprobs by up to {moved:.3f}")
    assert moved > 0.05
    text = (run_dir(tmp_path) / "logs" / "rollout-0.log").read_text()
    assert "--enable-lora" in text or "enable_lora=True" in text, text[-2000:]
    loads = text.count("POST /v1/load_lora_adapter HTTP/1.1\" 200")
    assert loads == 4, text[-3000:]  # versions 0, 1, 2 and 3
    assert "Loaded new LoRA adapter: name 'policy'" in text and "reload_weights" not in text, text[-2000:]

"""`tandem train` with LoRA (`actor.lora`), as a user runs it: at staleness 0 in fp32 the server's
logprobs equal the trainer's after every adapter update (`mismatch/max` <= 1e-5), every update is
verified (`train.verify_weights`: the adapter's checksums), each moves the adapter alone (`sync/mb`
a small fraction of the whole model), and the checkpoint holds the PEFT adapter; a merged export of
it (`tandem export-merged`) equals what the server holds. On a tiny Qwen3-MoE at `archon:d2e2`
with rollout routing replay (r3), where the attention takes adapters and the experts do not."""

from __future__ import annotations

import subprocess

import pytest

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

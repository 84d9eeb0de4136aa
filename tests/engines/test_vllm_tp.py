"""A real vLLM server (CPU build) at `--tensor-parallel-size 2`, two workers on the machine's two
cores, updated by Tandem's trainer side through its worker extension: both workers join ONE
transfer group (trainer rank 0, the workers ranks 1 and 2 of 3), each receives every tensor whole
and keeps its shard through vLLM's own loader at the commit. After a distributed update and after a
disk update the server decodes greedily exactly as transformers does on that checkpoint, and its
logprobs equal Tandem's recompute within 1e-5 (fp32). And `tandem train` with
`rollout.backend=vllm:d1t2` starts such a server and trains against it."""

from __future__ import annotations

import subprocess
import time

import pytest

from tandem.fleet import ops
from tandem.fleet.adapters import VLLMAdapter
from tandem.fleet.generation import GenerationParams
from tandem.fleet.http import HttpFleet
from tandem.launch import vllm
from tandem.launch.process import free_port
from tandem.models import load_model
from tandem.rollout.types import ModelRequest
from tandem.rollout.version import WeightVersion
from tandem.weights.meta import WeightUpdateMeta
from tandem.weights.report import WeightSyncError
from tandem.weights.updater import WeightUpdater
from tests.engines.conftest import MODEL_NAME, VLLMServer, init_model
from tests.engines.test_vllm import PROMPTS, client_for, generate, worst_logprob_error
from tests.engines.test_vllm_update import BUCKET, DEADLINES, greedy, hf_greedy
from tests.rl.common import TANDEM, rl_rows, run_dir, write_config
from tests.weights.common import CheckpointSource

TP = 2


@pytest.fixture(scope="module")
def tp_server(tmp_path_factory, small_model, vllm_python_path):
    spec = vllm.VLLMServerSpec(vllm_python_path, str(small_model), free_port(), served_model_name=MODEL_NAME,
                               threads=1, max_model_len=512, enforce_eager=True, tensor_parallel_size=TP)
    began = time.monotonic()
    proc = vllm.start(spec, tmp_path_factory.mktemp("vllm-tp") / "server.log", timeout_s=400)
    print(f"vLLM TP{TP} server healthy after {time.monotonic() - began:.1f}s")
    try:
        yield VLLMServer(spec.url, small_model, MODEL_NAME)
    finally:
        vllm.stop(proc)


@pytest.fixture(scope="module")
def seed1(tmp_path_factory):
    return init_model(tmp_path_factory.mktemp("seed1-tp") / "seed1", 1)


def fleet_for(server: VLLMServer, devices: int = TP) -> HttpFleet:
    return HttpFleet([server.url], adapter=VLLMAdapter(server.name, extension=True), deadlines=DEADLINES,
                     devices=devices)


def worst_error(server: VLLMServer, version: int, path) -> float:
    params = GenerationParams(max_new_tokens=16, temperature=0.7, ignore_eos=True)
    got = generate(client_for(server, WeightVersion(version)), [ModelRequest(list(p), params) for p in PROMPTS])
    return worst_logprob_error(load_model(path), got, 0.7)


def test_a_tensor_parallel_server_takes_distributed_and_disk_updates(tp_server, seed1, tmp_path):
    # Before any update: the server's own checkpoint, the reference for the other checks.
    assert greedy(tp_server, 0) == hf_greedy(tp_server.model)
    with fleet_for(tp_server) as fleet:
        steps = (("distributed", seed1, 1), ("disk", tp_server.model, 2), ("distributed", tp_server.model, 3),
                 ("disk", seed1, 4))
        for kind, path, version in steps:
            meta = WeightUpdateMeta(type=kind, bucket_bytes=BUCKET, deadlines=DEADLINES,
                                    path=str(tmp_path / "versions") if kind == "disk" else None)
            with WeightUpdater(CheckpointSource(path), fleet, meta) as updater:
                report = updater.update(version)
                if kind == "distributed":  # one group: the trainer and both workers of the server
                    assert updater.transport.group.world_size == 1 + TP
            error = worst_error(tp_server, version, path)
            print(f"TP{TP} {kind} update to {path.name} (v{version}): {report.buckets} buckets in "
                  f"{report.seconds:.2f}s; max logprob error {error:.2e}")
            assert greedy(tp_server, version) == hf_greedy(path), (kind, version)
            assert error < 1e-5, (kind, version, error)


def test_a_server_counted_with_the_wrong_devices_is_refused_by_name(tp_server):
    """The trainer counting one device for a TP2 server would form a group that never completes;
    each worker refuses the join at once, naming the setting to fix."""
    with fleet_for(tp_server, devices=1) as fleet:
        meta = WeightUpdateMeta(type="distributed", bucket_bytes=BUCKET, deadlines=DEADLINES)
        began = time.monotonic()
        with WeightUpdater(CheckpointSource(tp_server.model), fleet, meta) as updater, \
                pytest.raises(WeightSyncError, match=r"counts 1 device.*runs 2 worker.*rollout.backend"):
            updater.update(5)
        assert time.monotonic() - began < 30
        fleet.send(ops.CONTINUE, ops.ContinueGeneration()).result(30)  # the failed update left it paused


def test_train_with_a_launched_tensor_parallel_vllm_server(tmp_path, small_model, vllm_python_path):
    """`rollout.backend=vllm:d1t2`: Tandem starts one vLLM server of two workers and updates it over
    a group of 1 + 2 ranks after each step. Staleness 0: steps 2 and 3 train only on tokens the
    server sampled after the first and second update, and their logprobs equal the trainer's
    within 1e-5 (`mismatch/current_max`: |trainer - vLLM| on tokens of the current version, fp32)."""
    cfg = write_config(tmp_path, small_model, actor={"backend": "archon:d1"},
                       rollout={"backend": f"vllm:d1t{TP}", "server_args": [], "max_head_offpolicyness": 0,
                                "vllm": {"python": vllm_python_path, "threads": 1, "max_model_len": 512,
                                         "enforce_eager": True}},
                       train={"total_steps": 3, "weight_sync": "distributed"})
    proc = subprocess.run([TANDEM, "train", str(cfg)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = rl_rows(tmp_path)
    assert [r["version"] for r in rows] == [1.0, 2.0, 3.0]
    seen = [(r["step"], r["mismatch/current_n_tokens"], r["mismatch/current_max"]) for r in rows]
    print("(step, tokens of the current version, max |trainer - vLLM| logprob):", seen)
    assert all(n > 0 and worst < 1e-5 for _, n, worst in seen), seen
    text = (run_dir(tmp_path) / "logs" / "rollout-0.log").read_text()
    assert f"tensor_parallel_size={TP}" in text, text[-2000:]
    assert text.count("/collective_rpc") >= 6, text[-2000:]

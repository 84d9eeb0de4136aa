"""Tensor parallelism at world 2 (real processes, gloo, fp32) against one process: the Qwen TP
plan's logits, log-probs, entropy and gradients (tied and untied, Qwen3 q/k norms), and the
loss-parallel log-probs / entropy. One spawned group runs every check."""

from __future__ import annotations

import pytest
import torch

from tandem.errors import ConfigError
from tandem.parallel.tensor_parallel import check_divides, shard_range
from tests.distributed import run_distributed
from tests.parallel import tp_workers

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def results():
    return run_distributed(tp_workers.all_checks, 2, timeout=300)


@pytest.mark.parametrize("variant", ["qwen3 untied", "qwen3 tied", "qwen2 untied"])
def test_tp_model_equals_single_process(results, variant):
    for rank in results:
        r = rank["model"][variant]
        print(f"\n[tp2 {variant}] logits {r['logits']:.1e}; " + "; ".join(
            f"{k}: logprobs {r[k]['logprobs']:.1e} entropy {r[k]['entropy']:.1e} grad {r[k]['grad']:.1e}"
            for k in ("all", "wanted")))
        assert r["n_params"] == r["ref_n_params"]  # tied embeddings stay one parameter
        assert r["tied_shared"] == variant.endswith(" tied")
        assert r["logits"] <= 1e-5
        for key in ("all", "wanted"):
            assert r[key]["logprobs"] <= 1e-5 and r[key]["entropy"] <= 1e-5
            assert r[key]["grad"] <= 1e-5  # relative to each parameter's largest gradient
            # Without the TP sum the q/k-norm gradients are far off: the check above would fail.
            if variant.startswith("qwen3"):
                assert r[key]["unsummed_grad"] > 0.1 and r[key]["qk_grad_size"] > 0


def test_loss_parallel_equals_chunked_path(results):
    for rank in results:
        lp = rank["loss_parallel"]
        print(f"\n[loss parallel] {lp}")
        for temperature in (1.0, 0.6):
            assert lp[temperature]["logprobs"] <= 1e-6 and lp[temperature]["entropy"] <= 1e-6
            assert lp[temperature]["grad"] <= 1e-6
        assert lp["float64"]["logprobs"] <= 1e-5 and lp["float64"]["entropy"] <= 1e-6


def test_shard_range_and_divisibility_errors():
    assert [shard_range(37, 2, r) for r in range(2)] == [(0, 19), (19, 37)]
    assert [shard_range(5, 4, r) for r in range(4)] == [(0, 2), (2, 4), (4, 5), (5, 5)]
    with pytest.raises(ConfigError, match=r"tp=4 must divide the model's num_key_value_heads \(2\)"):
        check_divides(4, num_key_value_heads=2)


def test_run_config_refuses_indivisible_tp_at_load(tmp_path):
    from tandem.models.tiny import init_model
    from tandem.rl.config import load_run_config

    model = init_model(tmp_path / "tiny", preset="tiny")  # 4 query / 2 key-value heads
    cfg = load_run_config(None, [f"actor.path={model}", "actor.backend=archon:d2t2"])
    assert (cfg.actor.tp, cfg.actor.cp, cfg.actor.pp) == (2, 1, 1)
    with pytest.raises(ConfigError, match=r"actor.backend='archon:t4': .* num_key_value_heads \(2\) is not "
                                          r"divisible by 4"):
        load_run_config(None, [f"actor.path={model}", "actor.backend=archon:t4"])
    with pytest.raises(ConfigError, match=r"actor.parallelize.compile=true with actor.parallelize.activation_checkpoint="
                                          r"'full' is not supported with tensor parallelism \(tp=2\)"):
        load_run_config(None, [f"actor.path={model}", "actor.backend=archon:t2", "actor.parallelize.compile=true",
                               "actor.parallelize.activation_checkpoint=full"])
    with pytest.raises(ConfigError, match=r"activation_checkpoint=memory_budget is not supported with tensor parallelism "
                                          r"\(tp=2\): torch's min-cut partitioner cannot size the process group"):
        load_run_config(None, [f"actor.path={model}", "actor.backend=archon:t2", "actor.parallelize.compile=true",
                               "actor.parallelize.activation_checkpoint=memory_budget"])


def test_tp_plan_refuses_indivisible_kv_heads():
    from torch.distributed.device_mesh import DeviceMesh

    class FakeMesh(DeviceMesh):
        def __init__(self):  # only size() is read before the refusal
            pass

        def size(self, mesh_dim=None):
            return 4

    from tandem.models import build_model
    from tandem.models.qwen.tensor_plan import apply_tensor_parallel

    model = build_model(tp_workers.tp_config(False), device="meta")
    with pytest.raises(ConfigError, match="num_key_value_heads"):
        apply_tensor_parallel(model, FakeMesh())
    assert isinstance(model.output.weight, torch.nn.Parameter)

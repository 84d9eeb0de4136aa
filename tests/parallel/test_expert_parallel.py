"""Expert-parallel dispatch on two gloo ranks equals the plain MoE experts layer."""

from __future__ import annotations

from tandem.models.tiny import init_model
from tests.distributed import run_distributed
from tests.parallel import ep_workers


def test_dispatch_with_uneven_and_empty_splits_equals_plain_layer():
    results = run_distributed(ep_workers.dispatch_worker, world_size=2)
    for rank, diffs in enumerate(results):
        print(f"rank {rank}: {diffs}")
        assert diffs["out"] <= 1e-6 and diffs["x_grad"] <= 1e-6 and diffs["w_grad"] <= 1e-6
        assert diffs["w_grad_norm"] > 0  # every rank's experts received gradients


def test_engine_expert_layout(tmp_path):
    """d2e2: each rank holds 4 of the 8 experts (Shard(0) over ep; the expert FSDP mesh has size 1),
    and `full_tensor()` gathers the checkpoint's stacked weight."""
    model = init_model(tmp_path / "moe", arch="qwen3_moe", preset="tiny", seed=0)
    results = run_distributed(ep_workers.layout_worker, world_size=2, args=(str(model), "archon:d2e2"))
    for result in results:
        assert result["describe"] == "pp=1 dp_shard=2 dp_replicate=1 tp=1 cp=1 ep=2 etp=1 edp=1"
        assert result["local"] == (4, 32, 64) and result["full_equal"]
        assert "Shard(dim=0)" in result["placements"]

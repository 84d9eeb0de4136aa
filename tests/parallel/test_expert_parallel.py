"""Expert-parallel dispatch on two gloo ranks equals the plain MoE experts layer."""

from __future__ import annotations

import pytest

from tandem.models.tiny import init_model
from tandem.train import TrainEngine
from tests.distributed import run_distributed
from tests.parallel import ep_workers
from tests.train.helpers import engine_config, make_batch, rel_diff, train_steps


def test_dispatch_with_uneven_and_empty_splits_equals_plain_layer():
    results = run_distributed(ep_workers.dispatch_worker, world_size=2)
    for rank, diffs in enumerate(results):
        print(f"rank {rank}: {diffs}")
        assert diffs["out"] <= 1e-6 and diffs["x_grad"] <= 1e-6 and diffs["w_grad"] <= 1e-6
        assert diffs["w_grad_norm"] > 0  # every rank's experts received gradients


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory):
    return init_model(tmp_path_factory.mktemp("m") / "moe", arch="qwen3_moe", preset="tiny", seed=0)


def test_engine_expert_layout_and_resume(tmp_path, moe_model):
    """d2e2: each rank holds 4 of the 8 experts (Shard(0) over ep; the expert FSDP mesh has size 1),
    `full_tensor()` gathers the checkpoint's stacked weight, and a DCP state of the EP engine
    resumes exactly, and at d1 (DCP reshards the experts) to the same step."""
    results = run_distributed(ep_workers.layout_worker, world_size=2,
                              args=(str(moe_model), str(tmp_path), "archon:d2e2"))
    for result in results:
        assert result["describe"] == "pp=1 dp_shard=2 dp_replicate=1 tp=1 cp=1 ep=2 etp=1 edp=1"
        assert result["local"] == (4, 32, 64) and result["full_equal"]
        assert "Shard(dim=0)" in result["placements"]
        assert result["resumed"]["loss"] == result["stats"][2]["loss"]
        assert result["resumed"]["grad_norm"] == result["stats"][2]["grad_norm"]
    engine = TrainEngine(engine_config(str(moe_model)))
    engine.load_state(tmp_path / "state")
    step = train_steps(engine, make_batch(512), 1)[0]
    engine.close()
    assert rel_diff(step["loss"], results[0]["stats"][2]["loss"]) <= 1e-6
    assert rel_diff(step["grad_norm"], results[0]["stats"][2]["grad_norm"]) <= 1e-5



@pytest.mark.parametrize("backend", ["archon:t2e2", "archon:(attn:c2t2|ffn:e4)", "archon:d2t2e2",
                                     "archon:(attn:d2t2|ffn:e2t2)"])
def test_experts_sit_where_tandem_alloc_explains(moe_model, backend):
    """MoE parallel folding as `tandem alloc` explains it, checked on the engine's real mesh and
    weights: each rank holds the experts of its ep index (8 experts, ep shards of 8/ep in order),
    and its ep group is the ranks the explainer groups with it (folded: the TP and CP ranks)."""
    results = run_distributed(ep_workers.expert_mesh_worker, world_size=4 if "c2t2" in backend or "d2" in backend
                              else 2, args=(str(moe_model), backend))
    from tandem.config.alloc import parse_allocation

    sizes = parse_allocation(backend).components[0].sizes
    for rank, r in enumerate(results):
        shard = 8 // sizes.ep  # then FSDP splits an ep shard over the edp ranks holding it
        assert r["ep_rank"] == r["explained"]["ep"]
        assert set(r["held"]) <= set(range(r["ep_rank"] * shard, (r["ep_rank"] + 1) * shard)), (rank, r)
        # FSDP shards an ep shard over the data-parallel ranks that hold it: edp of them, whose TP
        # replicas (whole experts on every TP rank, not folded) hold the same FSDP shard.
        fsdp = sizes.edp // sizes.tp if sizes.etp == 1 and not sizes.ep_folds_tp else sizes.edp
        assert len(r["held"]) == shard // fsdp, (rank, r)
        same_group = [q for q in range(len(results)) if sizes.expert_coords(q)["edp"] == r["explained"]["edp"]
                      and sizes.expert_coords(q)["etp"] == r["explained"]["etp"]
                      and sizes.expert_coords(q)["pp"] == r["explained"]["pp"]]
        assert r["ep_peers"] == same_group, (rank, r)
    if sizes.ep_folds_tp:  # the folded layouts' ep groups take in the TP peers
        assert results[0]["ep_peers"] == list(range(sizes.ep))

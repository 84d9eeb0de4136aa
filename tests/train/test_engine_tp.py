"""TrainEngine with tensor parallelism: t2 (world 2) and d2t2 (world 4, FSDP x TP on one mesh)
against one rank (d1) on the same global batch, on the untied 4-layer tiny model: per-step loss,
grad norm, weights, log-probs, the bucketed export and saved HF weights, a DCP resume, and
per-block compile (t2) and activation checkpointing (d2t2). One spawned group per layout runs
every check."""

from __future__ import annotations

import pytest

from tandem.models.hf_checkpoint import iter_hf_tensors
from tandem.train import TrainEngine
from tests.distributed import run_distributed
from tests.train.dist_workers import MAIN_MB, split
from tests.train.helpers import engine_config, full_params, make_batch, max_param_diff, rel_diff, train_steps
from tests.train.tp_workers import SCHEDULE, STEPS, tp_engine_checks

LOSS_TOL, GRAD_NORM_TOL, WEIGHT_TOL = 1e-5, 1e-4, 1e-5
pytestmark = pytest.mark.slow
# name: (world size, tp, the extra run compiles the blocks (else: activation checkpointing); one
# layout pays the compile time)
LAYOUTS = {"t2": (2, 2, True), "d2t2": (4, 2, False)}


@pytest.fixture(scope="module")
def d1(untied4_dir):
    batch = make_batch(512)
    engine = TrainEngine(engine_config(str(untied4_dir), mb=MAIN_MB, **SCHEDULE))
    stats = train_steps(engine, batch, STEPS)
    res = {"stats": stats, "params": full_params(engine), "logprobs": engine.forward_logprobs(batch).logprobs}
    engine.close()
    return res


@pytest.fixture(scope="module", params=list(LAYOUTS))
def layout(request, untied4_dir, tmp_path_factory):
    world, tp, compile_blocks = LAYOUTS[request.param]
    out = tmp_path_factory.mktemp(request.param)
    return request.param, run_distributed(tp_engine_checks, world,
                                          args=(str(untied4_dir), str(out), tp, compile_blocks), timeout=400), out


def test_tp_layout_matches_d1(layout, d1):
    name, ranks, _ = layout
    dp = len(ranks) // 2
    for rank, r in enumerate(ranks):
        # 2 of the 4 query heads (head_dim 16) on each TP rank, their rows split again by FSDP.
        assert r["n_heads_local"][0] == 2 * 16 // dp
        assert "Shard(dim=1)" in r["placements"]["layers.0.attention.wo.weight"]  # row-parallel
        loss = max(rel_diff(a["loss"], b["loss"]) for a, b in zip(r["stats"], d1["stats"], strict=True))
        gnorm = max(rel_diff(a["grad_norm"], b["grad_norm"]) for a, b in zip(r["stats"], d1["stats"], strict=True))
        param = max_param_diff(r["params"], d1["params"])
        if rank == 0:
            print(f"\n[{name} vs d1, {STEPS} steps] max rel diff: loss {loss:.2e}, grad norm {gnorm:.2e}; "
                  f"max |weight diff| {param:.2e}")
        assert loss <= LOSS_TOL and gnorm <= GRAD_NORM_TOL and param <= WEIGHT_TOL
        assert [s["n_tokens"] for s in r["stats"]] == [s["n_tokens"] for s in d1["stats"]]
        # Log-probs of this rank's data-parallel shard, in its order.
        indices = split(dp)[r["dp_rank"]] if dp > 1 else range(len(d1["logprobs"]))
        diff = max((lp - d1["logprobs"][i]).abs().max().item() for i, lp in zip(indices, r["logprobs"], strict=True))
        assert diff <= LOSS_TOL


def test_tp_layout_export_save_resume_and_checkpointing(layout, d1):
    name, ranks, out = layout
    exported = {n: t for b in ranks[0]["export"] for n, t in b}
    assert exported.keys() == d1["params"].keys()
    assert all(bucket == [] for r in ranks[1:] for bucket in r["export"])  # exported to rank 0 only
    assert max_param_diff(exported, ranks[0]["params"]) == 0.0
    saved = dict(iter_hf_tensors(out / "hf"))
    assert saved.keys() == d1["params"].keys()
    assert {n: t.shape for n, t in saved.items()} == {n: t.shape for n, t in d1["params"].items()}
    assert max_param_diff(saved, d1["params"]) <= WEIGHT_TOL
    for r in ranks:
        # DCP state saved after step 2, resumed: step 3 again, exactly.
        assert r["resumed"]["loss"] == r["stats"][2]["loss"]
        assert r["resumed"]["grad_norm"] == r["stats"][2]["grad_norm"]
        # Compiled blocks (t2) / activation checkpointing (d2t2: recomputes the blocks, TP collectives
        # included) give the same step; both at once are refused, naming the keys.
        assert "activation_checkpoint: none or compile: false" in r["refused"]
        assert (r["compiled_graphs"] > 0) == LAYOUTS[name][2]
        assert rel_diff(r["checkpointed"]["loss"], r["stats"][0]["loss"]) <= LOSS_TOL
        assert rel_diff(r["checkpointed"]["grad_norm"], r["stats"][0]["grad_norm"]) <= GRAD_NORM_TOL

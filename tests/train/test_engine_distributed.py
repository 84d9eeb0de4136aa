"""TrainEngine at world size 2 (real processes, gloo) against world size 1 on the same global
batch. One spawned group runs every multi-rank check, to pay the spawn cost once."""

from __future__ import annotations

import pytest
import torch

from tandem.models.hf_checkpoint import iter_hf_tensors
from tandem.train import TrainEngine
from tests.distributed import run_distributed
from tests.train.dist_workers import (
    EXPORT_BYTES,
    MAIN_MB,
    SCHEDULE,
    UNEVEN_MB,
    engine_checks,
    split,
    uneven_split,
)
from tests.train.helpers import engine_config, full_params, make_batch, max_param_diff, rel_diff, train_steps

TOL = 1e-5
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def world2(tiny_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("world2")
    return run_distributed(engine_checks, 2, args=(str(tiny_dir), str(out)), timeout=300), out


@pytest.fixture(scope="module")
def world1(tiny_dir, tmp_path_factory):
    batch = make_batch(512)
    engine = TrainEngine(engine_config(str(tiny_dir), mb=MAIN_MB, **SCHEDULE))
    stats = train_steps(engine, batch, 3)
    res = {"stats": stats, "params": full_params(engine), "logprobs": engine.forward_logprobs(batch).logprobs}
    engine.close()
    engine = TrainEngine(engine_config(str(tiny_dir), mb=UNEVEN_MB))
    res["uneven"] = train_steps(engine, batch, 1)[0]
    res["uneven_logprobs"] = engine.forward_logprobs(batch).logprobs
    engine.close()
    return res


def test_world2_matches_world1(world2, world1):
    ranks, _ = world2
    for r in ranks:
        loss = max(rel_diff(a["loss"], b["loss"]) for a, b in zip(r["stats"], world1["stats"], strict=True))
        gnorm = max(rel_diff(a["grad_norm"], b["grad_norm"]) for a, b in zip(r["stats"], world1["stats"], strict=True))
        param = max_param_diff(r["params"], world1["params"])
        print(f"\n[world 2 vs 1] max rel diff: loss {loss:.2e}, grad norm {gnorm:.2e}; max |param diff| {param:.2e}")
        assert loss <= TOL and gnorm <= TOL and param <= TOL
        assert [s["n_tokens"] for s in r["stats"]] == [s["n_tokens"] for s in world1["stats"]]
        assert [s["lr"] for s in r["stats"]] == [s["lr"] for s in world1["stats"]]


def test_world2_logprobs_in_original_order(world2, world1):
    ranks, _ = world2
    diff = 0.0
    for rank, r in enumerate(ranks):
        for i, lp in zip(split(2)[rank], r["logprobs"], strict=True):
            diff = max(diff, (lp - world1["logprobs"][i]).abs().max().item())
    print(f"\n[world 2 logprobs] max |diff| vs world 1: {diff:.2e}")
    assert diff <= TOL


def test_uneven_split_pads_and_still_matches(world2, world1):
    ranks, _ = world2
    counts = [len(r["plan"]) for r in ranks]
    assert counts[0] == counts[1] and [] in ranks[0]["plan"]  # rank 0 pads to rank 1's count
    for r in ranks:
        assert r["uneven"]["n_mbs"] == counts[0]
        assert rel_diff(r["uneven"]["loss"], world1["uneven"]["loss"]) <= TOL
        assert rel_diff(r["uneven"]["grad_norm"], world1["uneven"]["grad_norm"]) <= TOL
    diff = 0.0
    for rank, r in enumerate(ranks):
        for i, lp in zip(uneven_split(2)[rank], r["uneven_logprobs"], strict=True):
            diff = max(diff, (lp - world1["uneven_logprobs"][i]).abs().max().item())
    print(f"\n[uneven split] {counts[0]} micro-batches per rank; max |logprob diff| vs world 1: {diff:.2e}")
    assert diff <= TOL


def test_world2_resume_equals_uninterrupted(world2, tiny_dir):
    ranks, out = world2
    for r in ranks:
        print(f"\n[world 2 resume] {r['resumed']['loss']!r} vs {r['stats'][2]['loss']!r}")
        assert r["resumed"]["loss"] == r["stats"][2]["loss"]
        assert r["resumed"]["grad_norm"] == r["stats"][2]["grad_norm"]
    # DCP reshards: the world-2 state resumes at world 1 too.
    engine = TrainEngine(engine_config(str(tiny_dir), mb=MAIN_MB, **SCHEDULE))
    engine.load_state(out / "state")
    stats = train_steps(engine, make_batch(512), 1)[0]
    engine.close()
    assert rel_diff(stats["loss"], ranks[0]["stats"][2]["loss"]) <= TOL


def test_world2_export_and_save_hf(world2, world1):
    ranks, out = world2
    orders = [[n for b in r["export"] for n, _ in b] for r in ranks]
    assert orders[0] == orders[1] and len(orders[0]) == len(set(orders[0]))
    assert [len(b) for b in ranks[0]["export"]] == [len(b) for b in ranks[1]["export"]]
    for r in ranks:
        for bucket in r["export"]:
            assert len(bucket) == 1 or sum(t.numel() * t.element_size() for _, t in bucket) <= EXPORT_BYTES
        exported = {n: t for b in r["export"] for n, t in b}
        assert all(torch.equal(exported[n], r["params"][n]) for n in exported)
    saved = dict(iter_hf_tensors(out / "hf"))
    assert saved.keys() == ranks[0]["params"].keys()
    assert all(torch.equal(saved[n], ranks[0]["params"][n]) for n in saved)
    assert max_param_diff(saved, world1["params"]) <= TOL

"""Weight export of a mixture-of-experts model: a stacked expert parameter is gathered once and
leaves as its per-expert HF tensors. At trainer world 1 and 2 (FSDP), the export of a tiny
Qwen3-MoE equals the HF checkpoint it was loaded from (names, shapes, values, nothing twice), in
buckets cut between parameters, gathered to rank 0 into per-HF-tensor destinations, saved."""

from __future__ import annotations

import re

import pytest
import torch

from tandem.models.hf_checkpoint import iter_hf_tensors
from tandem.models.tiny import init_model
from tests.distributed import run_distributed
from tests.train.moe_export_workers import (
    EXPORT_BYTES,
    ep_like_export,
    gather_pieces,
    moe_export,
    moe_pipeline_export,
)


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    return init_model(tmp_path_factory.mktemp("moe") / "m", arch="qwen3_moe", preset="tiny", seed=3)


def _check_equals_checkpoint(named: list[tuple[str, torch.Tensor]], reference: dict[str, torch.Tensor],
                             dtype: torch.dtype) -> None:
    names = [n for n, _ in named]
    assert len(names) == len(set(names)), "an HF tensor exported twice"
    assert sorted(names) == sorted(reference)
    bad = [n for n, t in named if not (t.dtype == dtype and torch.equal(t, reference[n].to(dtype)))]
    assert not bad, bad[:5]


def _check_size_and_rank0_export(res: dict, rank: int, reference: dict[str, torch.Tensor]) -> None:
    """`export_nbytes` counts every HF tensor (64-byte aligned, fp32); the export to rank 0 (bf16,
    into the caller's destinations) equals the checkpoint there and is empty elsewhere."""
    assert res["nbytes"] == sum(-(-t.numel() * 4 // 64) * 64 for t in reference.values())
    if rank == 0:
        _check_equals_checkpoint(res["to_rank0"], reference, torch.bfloat16)
        assert res["in_alloc"]
    else:
        assert res["to_rank0"] == []


def _parameter_of(hf_name: str) -> str:
    """The native parameter an HF tensor belongs to, as a key: expert pieces map to their stack."""
    m = re.fullmatch(r"model\.layers\.(\d+)\.mlp\.experts\.\d+\.(\w+)\.weight", hf_name)
    return f"{m[1]}.{m[2]}" if m else hf_name


@pytest.mark.parametrize("world, ep", [(1, 1), (2, 1), (2, 2)], ids=["d1", "d2", "d2e2"])
def test_moe_export_equals_the_checkpoint(moe_dir, tmp_path, world, ep):
    reference = dict(iter_hf_tensors(moe_dir))
    assert any(".mlp.experts.7.down_proj.weight" in n for n in reference)  # the checkpoint holds pieces
    results = run_distributed(moe_export, world, args=(str(moe_dir), str(tmp_path), ep), timeout=300)
    for rank, res in enumerate(results):
        if ep > 1:  # the experts really are split over the ranks (4 of 8 each), sharded on dim 0
            assert res["layout"][0][0] == 8 // ep and "Shard(dim=0)" in res["layout"][1], res["layout"]
        buckets = res["buckets"]
        _check_equals_checkpoint([t for b in buckets for t in b], reference, torch.float32)
        # Cut between parameters: an expert stack's pieces share a bucket, and a bucket over the
        # limit holds one parameter (one tensor, or all the pieces of one stack).
        owner = [[_parameter_of(n) for n, _ in b] for b in buckets]
        for b, params in zip(buckets, owner, strict=True):
            assert sum(t.numel() * 4 for _, t in b) <= EXPORT_BYTES or len(set(params)) == 1, params
        where: dict[str, set[int]] = {}
        for k, params in enumerate(owner):
            for p in params:
                where.setdefault(p, set()).add(k)
        assert all(len(ks) == 1 for ks in where.values()), where
        assert sum(1 for p in where if p.endswith("_proj")) == 6  # 2 layers x gate/up/down stacks
        _check_size_and_rank0_export(res, rank, reference)
        if world == 1:
            local = [t for group in res["local"] for t in group]
            _check_equals_checkpoint(local, reference, torch.float32)
        else:
            assert res["local"] is None
    _check_equals_checkpoint(list(iter_hf_tensors(tmp_path / "hf")), reference, torch.float32)


def test_gather_bucket_splits_any_placement_into_pieces():
    for rank, res in enumerate(run_distributed(gather_pieces, 2, timeout=120)):
        for label, checks in res.items():
            assert all(checks.values()), (rank, label, checks)


@pytest.mark.slow
@pytest.mark.parametrize("world, ep", [(2, 1), (4, 2)], ids=["p2", "d2p2e2"])
def test_moe_pipeline_export_equals_the_checkpoint(moe_dir, tmp_path, world, ep):
    """Pipeline parallel (pp=2), also with experts over an EP mesh: each stage's expert stacks leave
    as HF pieces, to every rank and to rank 0 (the last stage's buckets travel point to point)."""
    reference = dict(iter_hf_tensors(moe_dir))
    results = run_distributed(moe_pipeline_export, world, args=(str(moe_dir), str(tmp_path), ep), timeout=300)
    for rank, res in enumerate(results):
        _check_equals_checkpoint([t for b in res["buckets"] for t in b], reference, torch.float32)
        _check_size_and_rank0_export(res, rank, reference)
    _check_equals_checkpoint(list(iter_hf_tensors(tmp_path / "hf")), reference, torch.float32)


def test_moe_export_of_an_expert_parallel_layout(moe_dir):
    """Experts sharded over an EP mesh, the rest over another: the `full_tensor()` path of every
    bucket still yields the checkpoint's HF tensors."""
    reference = dict(iter_hf_tensors(moe_dir))
    for rank, res in enumerate(run_distributed(ep_like_export, 2, args=(str(moe_dir),), timeout=120)):
        assert res["sharded"]
        _check_equals_checkpoint(res["everywhere"], reference, torch.float32)
        if rank == 0:
            _check_equals_checkpoint(res["to_rank0"], reference, torch.bfloat16)
        else:
            assert res["to_rank0"] == []

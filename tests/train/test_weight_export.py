"""`gather_bucket`: one all-gather per bucket of FSDP / HSDP shards, on real gloo process groups,
equal to DTensor's own per-parameter gather bit for bit (uneven and empty shards included), and
the tensors of a bucket stay intact when the next bucket reuses the gather buffer; gathered to one
rank (`dst`), the same tensors there and nothing elsewhere."""

from __future__ import annotations

import pytest

from tests.distributed import run_distributed
from tests.train.dist_workers import gather_bucket_checks


@pytest.mark.parametrize("mesh_shape", [(3,), (2, 2)], ids=["fsdp-3", "hsdp-2x2"])
def test_gather_bucket_equals_full_tensor(mesh_shape):
    world = 1
    for n in mesh_shape:
        world *= n
    results = run_distributed(gather_bucket_checks, world, args=(mesh_shape,), timeout=120)
    for rank, r in enumerate(results):
        assert r["fused_calls"] == 3, (rank, r)  # each of the three buckets in one all-gather
        assert all(r["fused_equal"]) and all(r["fused_exact"]), (rank, r)
        assert all(r["mixed_equal"]), (rank, r)
        assert r["names"] == ["p0", "p1", "p2", "p3", "p4", "p0", "p1", "r"]
        # dst=0: the whole bucket on rank 0 only, without an all-gather
        assert r["to_rank0"] == ([True] * 5 if rank == 0 else []), (rank, r)
        assert r["all_gathers_after"] == 0, (rank, r)

"""Expert-parallel dispatch on two gloo ranks equals the plain MoE experts layer."""

from __future__ import annotations

from tests.distributed import run_distributed
from tests.parallel import ep_workers


def test_dispatch_with_uneven_and_empty_splits_equals_plain_layer():
    results = run_distributed(ep_workers.dispatch_worker, world_size=2)
    for rank, diffs in enumerate(results):
        print(f"rank {rank}: {diffs}")
        assert diffs["out"] <= 1e-6 and diffs["x_grad"] <= 1e-6 and diffs["w_grad"] <= 1e-6
        assert diffs["w_grad_norm"] > 0  # every rank's experts received gradients

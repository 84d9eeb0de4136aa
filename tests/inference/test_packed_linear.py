"""Serving linears over oneDNN-prepacked weights: F.linear's results, never a stale weight, a
bounded set of row counts (tandem/inference/packed_linear.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tandem.inference.packed_linear import MAX_ROWS, PackedLinear, pack_linears, rows_bucket


def _linear(dtype: torch.dtype, bias: bool = True) -> nn.Linear:
    torch.manual_seed(0)
    return nn.Linear(96, 80, bias=bias, dtype=dtype)


@pytest.mark.parametrize("rows", [1, 15, 16, 17, 255, 256, 257, 600])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_equals_f_linear(rows, dtype):
    linear = _linear(dtype)
    packed = PackedLinear(linear)
    x = torch.randn(rows, 96, dtype=dtype)
    with torch.inference_mode():
        got, want = packed(x), F.linear(x, linear.weight, linear.bias)
    assert got.shape == want.shape and got.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 1e-2  # fp32: summation order; bf16: one rounding of the output
    assert (got.float() - want.float()).abs().max() <= tol * want.float().abs().max()


def test_every_kind_of_weight_change_is_served_at_once():
    linear = _linear(torch.float32)
    packed = PackedLinear(linear)
    x = torch.randn(5, 96)

    def check():
        with torch.inference_mode():
            assert torch.allclose(packed(x), F.linear(x, linear.weight, linear.bias), atol=1e-5)

    check()
    with torch.no_grad():
        linear.weight.copy_(torch.randn(80, 96))  # an update copied in place (same storage)
    check()
    linear.weight.data = torch.randn(80, 96)  # an adopted staging buffer or shared-memory segment
    check()
    with torch.no_grad():
        linear.weight[3].copy_(torch.randn(96))  # one piece of a stacked parameter
    check()
    with torch.no_grad():
        linear.bias.copy_(torch.randn(80))  # the bias is never packed: always current
    check()


def test_pack_linears_keeps_names_and_parameters():
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Sequential(nn.Linear(8, 4, bias=False)))
    before = dict(model.named_parameters())
    assert pack_linears(model) == 2
    assert isinstance(model[0], PackedLinear) and isinstance(model[2][0], PackedLinear)
    after = dict(model.named_parameters())
    assert after.keys() == before.keys() and all(after[k] is before[k] for k in before)
    assert set(model.state_dict()) == set(before)  # the packed copies are not state


def test_row_counts_are_bucketed():
    buckets = {rows_bucket(r) for r in range(1, MAX_ROWS + 1)}
    assert len(buckets) == 16 and max(buckets) == MAX_ROWS
    assert all(0 <= rows_bucket(r) - r < 16 for r in range(1, MAX_ROWS + 1))

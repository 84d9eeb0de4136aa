"""The MoE layer against hand computations: grouped experts, routing, replay, load balancing."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tandem.models.common import MoE, Routing, grouped_swiglu, load_balancing_loss


def _per_expert_loop(x, counts, w1, w2, w3):
    out, start = [], 0
    for e, n in enumerate(counts.tolist()):
        rows = x[start: start + n]
        out.append((F.silu(rows @ w1[e].T) * (rows @ w3[e].T)) @ w2[e].T)
        start += n
    return torch.cat(out)


@pytest.mark.parametrize("counts", [[3, 0, 5, 1], [0, 0, 0, 4], [0, 0, 0, 0], [2, 2, 2, 2]])
def test_grouped_swiglu_equals_a_loop_over_experts_with_empty_ones(counts):
    torch.manual_seed(0)
    counts_t = torch.tensor(counts)
    x = torch.randn(int(counts_t.sum()), 6, requires_grad=True)
    w1, w3, w2 = torch.randn(4, 5, 6), torch.randn(4, 5, 6), torch.randn(4, 6, 5, requires_grad=True)
    got = grouped_swiglu(x, counts_t, w1, w2, w3)
    want = _per_expert_loop(x, counts_t, w1, w2, w3)
    assert got.shape == (int(counts_t.sum()), 6)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    got.sum().backward()  # differentiable; every expert's weight gets a gradient (zero when unused)
    assert w2.grad is not None and all(w2.grad[e].abs().sum() == 0 for e, n in enumerate(counts) if n == 0)


def _moe(norm: bool) -> MoE:
    torch.manual_seed(1)
    moe = MoE(layer=3, dim=8, hidden_dim=4, num_experts=5, top_k=2, norm_topk_prob=norm)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, 0.5)
    return moe


@pytest.mark.parametrize("norm", [False, True])
def test_moe_output_is_the_weighted_sum_of_the_chosen_experts(norm):
    moe = _moe(norm)
    x = torch.randn(7, 8)
    routing = Routing(record=True, keep_logits=True)
    got = moe(x, routing)
    probs = torch.softmax(x @ moe.router.weight.T, -1)
    top = probs.topk(2, -1)
    weights = top.values / top.values.sum(-1, keepdim=True) if norm else top.values
    e = moe.experts
    want = torch.stack([
        sum(weights[t, j] * (F.silu(x[t] @ e.w1[i].T) * (x[t] @ e.w3[i].T)) @ e.w2[i].T
            for j, i in enumerate(top.indices[t].tolist()))
        for t in range(7)])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert torch.equal(routing.recorded[3], top.indices)
    assert routing.logits[3].shape == (7, 5) and routing.logits[3].dtype == torch.float32


def test_replay_fixes_the_experts_keeps_live_weights_and_router_gradients():
    moe = _moe(norm=True)
    x = torch.randn(6, 8)
    live = Routing(record=True)
    moe(x, live)
    forced = (live.recorded[3] + 1) % 5  # other experts than the router would pick
    forced[2] = -1  # no recorded route: routed live
    replay = Routing(replay={3: forced}, record=True)
    out = moe(x, replay)
    used = replay.recorded[3]
    assert torch.equal(used[[0, 1, 3, 4, 5]], forced[[0, 1, 3, 4, 5]])
    assert torch.equal(used[2], live.recorded[3][2])
    # Same as a forward that picked those experts with weights from the live probabilities.
    probs = torch.softmax(x @ moe.router.weight.T, -1)
    w = probs.gather(-1, used)
    want = moe.experts(x, used, w / w.sum(-1, keepdim=True))
    torch.testing.assert_close(out, want)
    out.square().sum().backward()
    assert moe.router.weight.grad is not None and moe.router.weight.grad.abs().sum() > 0
    with pytest.raises(ValueError, match="shape"):
        moe(x, Routing(replay={3: forced[:, :1]}))


def test_load_balancing_loss_is_one_when_uniform_and_larger_when_skewed():
    uniform = torch.zeros(8, 4)
    assert load_balancing_loss([uniform], top_k=2).item() == pytest.approx(1.0)
    skewed = torch.tensor([[5.0, 4.0, 0.0, 0.0]]).repeat(8, 1)
    assert load_balancing_loss([skewed, uniform], top_k=2).item() > 1.2

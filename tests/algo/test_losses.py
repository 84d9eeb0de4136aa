"""The decoupled PPO policy loss and the value loss on hand-computed cases.

Micro-batches are built directly in prediction alignment (what the engine hands a loss function):
position t holds the values of the token `logprobs[t]` is about.
"""

from __future__ import annotations

import math

import pytest
import torch

from tandem.algo import (
    PPOConfig,
    ValueLoss,
    loglinear_prox_logprobs,
    make_policy_loss,
    policy_loss_weight,
    summarize_stats,
    value_loss,
)
from tandem.data.batch import pack_sequences
from tandem.train import MicroBatch, SequenceBatch

LN2, LN10 = math.log(2.0), math.log(10.0)


def mb_of(lengths, **tokens) -> MicroBatch:
    t = sum(lengths)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    toks = {k: torch.as_tensor(v, dtype=torch.long if k in ("loss_mask", "versions") else torch.float32)
            for k, v in tokens.items()}
    toks.setdefault("loss_mask", torch.ones(t, dtype=torch.long))
    return MicroBatch(list(range(len(lengths))), torch.zeros(t, dtype=torch.long), cu, toks)


def run(cfg, theta, mb, stats=None, version=None):
    lp = torch.tensor(theta, dtype=torch.float32, requires_grad=True)
    loss = make_policy_loss(cfg, version=version, stats=stats)(lp, torch.zeros_like(lp), mb)
    loss.backward()
    return loss.item(), lp.grad


def test_on_policy_invariant_ratio_and_weight_are_one():
    # Staleness 0, first minibatch: logp_theta == logp_prox == logp_behave. r = exp(0) = 1 and
    # w = exp(0) = 1 exactly, so the loss sum is -sum(A) over loss tokens (token mean -mean(A))
    # and d loss / d logp_t = -A_t on loss tokens, 0 elsewhere.
    lp = [-0.3, -1.7, -0.9, -2.2, -0.05]
    adv = [0.5, -1.0, 2.0, 7.0, 1.5]
    mask = [1, 1, 1, 0, 1]
    mb = mb_of([3, 2], logprobs=lp, prox_logprobs=lp, advantages=adv, loss_mask=mask)
    stats: dict = {}
    loss, grad = run(PPOConfig(), lp, mb, stats)
    assert loss == pytest.approx(-(0.5 - 1.0 + 2.0 + 1.5))  # -3.0
    assert loss / float(policy_loss_weight(mb)) == pytest.approx(-3.0 / 4)
    assert grad.tolist() == pytest.approx([-0.5, 1.0, -2.0, 0.0, -1.5])
    s = summarize_stats(stats)
    assert s["ratio"] == 1.0 and s["ratio_max"] == 1.0  # exactly
    assert s["imp_weight"] == 1.0 and s["imp_weight_max"] == 1.0
    assert s["clip_frac"] == 0.0 and s["behave_cap_frac"] == 0.0 and s["approx_kl"] == 0.0
    assert s["n_loss_tokens"] == 4 and s["loss"] == pytest.approx(-0.75)


def test_behaviour_weight_changes_the_gradient():
    # Same theta and prox; behaviour = prox gives w = 1, behaviour = prox - ln 2 gives w = 2 on
    # every token, which doubles loss and gradient (w is a constant factor, no grad through it).
    theta = [-1.0, -0.5]
    prox = [-1.1, -0.4]
    adv = [1.0, -1.0]
    cfg = PPOConfig(eps_clip=0.5)
    loss_eq, grad_eq = run(cfg, theta, mb_of([2], logprobs=prox, prox_logprobs=prox, advantages=adv))
    behave = [p - LN2 for p in prox]
    loss_w, grad_w = run(cfg, theta, mb_of([2], logprobs=behave, prox_logprobs=prox, advantages=adv))
    # r = exp(0.1) = 1.1051709, exp(-0.1) = 0.9048374 (inside the clip range 0.5..1.5):
    # loss = -1 * 1.1051709 + 1 * 0.9048374 = -0.2003335; grad = -A r = -1.1051709, 0.9048374.
    assert loss_eq == pytest.approx(-math.exp(0.1) + math.exp(-0.1), abs=1e-6)
    assert grad_eq.tolist() == pytest.approx([-math.exp(0.1), math.exp(-0.1)], abs=1e-6)
    assert loss_w == pytest.approx(2 * loss_eq, abs=1e-6)
    assert grad_w.tolist() == pytest.approx((2 * grad_eq).tolist(), abs=1e-6)
    assert not torch.allclose(grad_w, grad_eq)
    # With the correction off (allowed only on-policy), behaviour logprobs are ignored.
    off = PPOConfig(eps_clip=0.5, behave_imp_weight_mode="off")
    _, grad_off = run(off, theta, mb_of([2], logprobs=behave, prox_logprobs=prox, advantages=adv))
    assert torch.allclose(grad_off, grad_eq)
    # ... and when behaviour == proximal, the weight (w = 1) changes nothing either.
    _, grad_off_eq = run(off, theta, mb_of([2], logprobs=prox, prox_logprobs=prox, advantages=adv))
    assert torch.equal(grad_off_eq, grad_eq)


def test_asymmetric_clip_dapo():
    # eps 0.2 / eps_high 0.28, ratio r = exp(theta - prox):
    # tok0 A=+1, r=1.25 -> inside [0.8, 1.28]: pg = -1.25, grad -A r = -1.25
    # tok1 A=+1, r=1.50 -> clipped at 1.28: pg = max(-1.5, -1.28) = -1.28, grad 0
    # tok2 A=-1, r=0.70 -> clipped at 0.8: pg = max(0.7, 0.8) = 0.8, grad 0
    # tok3 A=-1, r=1.50 -> pg = max(1.5, 1.28) = 1.5 (unclipped, pessimistic), grad -A r = 1.5
    ratios = [1.25, 1.5, 0.7, 1.5]
    theta = [math.log(r) for r in ratios]
    mb = mb_of([4], logprobs=[0.0] * 4, prox_logprobs=[0.0] * 4, advantages=[1, 1, -1, -1])
    stats: dict = {}
    loss, grad = run(PPOConfig(eps_clip=0.2, eps_clip_higher=0.28), theta, mb, stats)
    assert loss == pytest.approx(-1.25 - 1.28 + 0.8 + 1.5, abs=1e-6)
    assert grad.tolist() == pytest.approx([-1.25, 0.0, 0.0, 1.5], abs=1e-6)
    assert summarize_stats(stats)["clip_frac"] == pytest.approx(0.5)
    # Symmetric 0.2: tok0 is now clipped at 1.2: -1.2 - 1.2 + 0.8 + 1.5.
    loss, grad = run(PPOConfig(eps_clip=0.2), theta, mb)
    assert loss == pytest.approx(-1.2 - 1.2 + 0.8 + 1.5, abs=1e-6)
    assert grad.tolist() == pytest.approx([0.0, 0.0, 0.0, 1.5], abs=1e-6)


def test_dual_clip():
    # A = -1, r = 4: pg = max(-A r, -A clip(r)) = max(4, 1.2) = 4; dual clip c = 3 bounds it at
    # c |A| = 3 (a constant: no grad). A = +1, r = 4: pg = max(-4, -1.2) = -1.2, dual clip n/a.
    # A = -1, r = 2: pg = 2 < 3, untouched, grad -A r = 2.
    theta = [math.log(4.0), math.log(4.0), math.log(2.0)]
    mb = mb_of([3], logprobs=[0.0] * 3, prox_logprobs=[0.0] * 3, advantages=[-1.0, 1.0, -1.0])
    stats: dict = {}
    loss, grad = run(PPOConfig(dual_clip=3.0), theta, mb, stats)
    assert loss == pytest.approx(3.0 - 1.2 + 2.0, abs=1e-6)
    assert grad.tolist() == pytest.approx([0.0, 0.0, 2.0], abs=1e-6)
    assert summarize_stats(stats)["dual_clip_frac"] == pytest.approx(1 / 3)
    loss, _ = run(PPOConfig(), theta, mb)
    assert loss == pytest.approx(4.0 - 1.2 + 2.0, abs=1e-6)


def test_gspo_sequence_ratio():
    # One sequence, log ratios 0.2 and -0.1 -> mean 0.05, s = exp(0.05) = 1.0512711 (in range);
    # advantage = mean(1, 3) = 2. Per token pg = -2 s, two tokens: loss = -4 s = -4.2050842.
    # d loss / d logp_t = -4 s * (1/2) = -2 s = -2.1025421 for both tokens.
    cfg = PPOConfig(importance_level="sequence")
    mb = mb_of([3], logprobs=[0.0] * 3, prox_logprobs=[0.0] * 3, advantages=[1.0, 3.0, 9.0], loss_mask=[1, 1, 0])
    loss, grad = run(cfg, [0.2, -0.1, 5.0], mb)
    s = math.exp(0.05)
    assert loss == pytest.approx(-4 * s, abs=1e-6)
    assert grad.tolist() == pytest.approx([-2 * s, -2 * s, 0.0], abs=1e-6)
    # Token level on the same inputs: r = 1.2214028 (clipped to 1.2 for A=1), 0.9048374:
    # loss = -1.2 - 3 * 0.9048374 = -3.9145123 -- a different objective.
    loss_tok, _ = run(PPOConfig(), [0.2, -0.1, 5.0], mb)
    assert loss_tok == pytest.approx(-1.2 - 3 * math.exp(-0.1), abs=1e-6)
    # Sequence ratio exp(0.5) = 1.6487 is clipped at 1.2: loss = 2 * (-2 * 1.2) = -4.8, no grad.
    loss, grad = run(cfg, [0.5, 0.5, 0.0], mb)
    assert loss == pytest.approx(-4.8, abs=1e-6) and grad.abs().max() == 0
    # Two sequences in one micro-batch keep separate ratios: seq0 log r 0.1 -> A 1,
    # seq1 log r -0.1 with A -1: loss = -exp(0.1) + exp(-0.1) = -0.2003335.
    mb2 = mb_of([1, 1], logprobs=[0.0, 0.0], prox_logprobs=[0.0, 0.0], advantages=[1.0, -1.0])
    loss, _ = run(cfg, [0.1, -0.1], mb2)
    assert loss == pytest.approx(-math.exp(0.1) + math.exp(-0.1), abs=1e-6)


def test_cap_mask_vs_clamp():
    # theta = prox (r = 1), A = 1, w = exp(prox - behave) = 1, 2, 10, cap 5:
    # mask:  loss = -1*1 - 1*2 - 0 (10 > 5 masked) = -3
    # clamp: loss = -1*1 - 1*2 - 1*5                = -8
    prox = [-1.0, -1.0, -1.0]
    behave = [-1.0, -1.0 - LN2, -1.0 - LN10]
    mb = mb_of([3], logprobs=behave, prox_logprobs=prox, advantages=[1.0, 1.0, 1.0])
    stats: dict = {}
    loss, grad = run(PPOConfig(behave_imp_weight_mode="mask"), prox, mb, stats)
    assert loss == pytest.approx(-3.0, abs=1e-5)
    assert grad.tolist() == pytest.approx([-1.0, -2.0, 0.0], abs=1e-5)
    s = summarize_stats(stats)
    assert s["behave_cap_frac"] == pytest.approx(1 / 3)
    assert s["imp_weight"] == pytest.approx(13 / 3, abs=1e-5) and s["imp_weight_max"] == pytest.approx(10.0, abs=1e-5)
    loss, grad = run(PPOConfig(behave_imp_weight_mode="clamp"), prox, mb)
    assert loss == pytest.approx(-8.0, abs=1e-5)
    assert grad.tolist() == pytest.approx([-1.0, -2.0, -5.0], abs=1e-5)


def test_sequence_level_behaviour_weight():
    # One sequence, log w = ln 2, ln 8 -> mean ln 4 -> w = 4 on both tokens (geometric mean of 2
    # and 8). r = 1, A = 1: loss = -4 - 4 = -8. Token level with cap 5: -2 + 0 (8 masked) = -2.
    # Sequence level with cap 3: the whole sequence (w = 4 > 3) is masked: 0.
    prox = [0.0, 0.0]
    behave = [-LN2, -math.log(8.0)]
    mb = mb_of([2], logprobs=behave, prox_logprobs=prox, advantages=[1.0, 1.0])
    loss, _ = run(PPOConfig(behave_imp_weight_level="sequence"), prox, mb)
    assert loss == pytest.approx(-8.0, abs=1e-5)
    loss, _ = run(PPOConfig(), prox, mb)
    assert loss == pytest.approx(-2.0, abs=1e-5)
    loss, grad = run(PPOConfig(behave_imp_weight_level="sequence", behave_imp_weight_cap=3.0), prox, mb)
    assert loss == 0.0 and grad.abs().max() == 0


def test_loglinear_proximal_approximation():
    # Trainer version 5: v_prox = 5, v_theta = 6. behave -1, theta -0.5 on every token.
    # v_b = 5: alpha = (5-5)/(6-5) = 0       -> prox = -1
    # v_b = 4: alpha = (5-4)/(6-4) = 1/2     -> prox = -1 + 0.5 * 0.5 = -0.75
    # v_b = 3: alpha = (5-3)/(6-3) = 2/3     -> prox = -1 + (2/3) * 0.5 = -0.6666667
    # v_b = -1 (prompt): alpha = 0           -> prox = behave
    theta = torch.tensor([-0.5, -0.5, -0.5, -0.5], requires_grad=True)
    behave = torch.tensor([-1.0, -1.0, -1.0, 0.0])
    prox = loglinear_prox_logprobs(theta, behave, torch.tensor([5, 4, 3, -1]), version=5)
    assert prox.tolist() == pytest.approx([-1.0, -0.75, -1 + 1 / 3, 0.0], abs=1e-6)
    assert not prox.requires_grad
    # In the loss (A = 1, wide clip): r = exp(theta - prox) = e^0.5, e^0.25, e^(1/6);
    # w = exp(prox - behave) = 1, e^0.25, e^(1/3); loss = -sum(r w) = -3 e^0.5 (r w = e^0.5 each).
    cfg = PPOConfig(prox_logp="loglinear", eps_clip=0.9, eps_clip_higher=10.0)
    mb = mb_of([4], logprobs=behave.tolist(), versions=[5, 4, 3, -1], advantages=[1.0] * 4, loss_mask=[1, 1, 1, 0])
    loss, grad = run(cfg, theta.tolist(), mb, version=5)
    assert loss == pytest.approx(-3 * math.exp(0.5), abs=1e-5)
    # grad = -A r w (the ratio's grad only: prox is detached): -e^0.5 on each loss token.
    assert grad.tolist() == pytest.approx([-math.exp(0.5)] * 3 + [0.0], abs=1e-5)
    with pytest.raises(ValueError, match="version"):
        make_policy_loss(cfg)


def test_missing_inputs_are_named():
    mb = mb_of([2], logprobs=[0.0, 0.0], advantages=[1.0, 1.0])
    with pytest.raises(KeyError, match="set_prox_logprobs"):
        run(PPOConfig(), [0.0, 0.0], mb)


def test_stats_accumulate_over_micro_batches_and_record_mismatch():
    # Two micro-batches of 2 and 1 loss tokens; clip hits 1 of 2, then 1 of 1: clip_frac = 2/3.
    # Tokens of version 3 (current): |theta - behave| = 0.1 and 0.3 -> mean 0.2, max 0.3.
    stats: dict = {}
    mb1 = mb_of([2], logprobs=[-1.1, -2.0], prox_logprobs=[-1.0, -2.0], advantages=[1.0, 1.0], versions=[3, 2])
    theta2 = -1.0 + math.log(1.5)  # r = 1.5: clipped
    mb2 = mb_of([1], logprobs=[theta2 - 0.3], prox_logprobs=[-1.0], advantages=[1.0], versions=[3])
    run(PPOConfig(), [-1.0, -2.0 + math.log(2.0)], mb1, stats, version=3)
    run(PPOConfig(), [theta2], mb2, stats, version=3)
    s = summarize_stats(stats)
    assert s["n_loss_tokens"] == 3 and s["clip_frac"] == pytest.approx(2 / 3)
    assert s["n_current_tokens"] == 2
    assert s["theta_behave_absdiff"] == pytest.approx(0.2, abs=1e-6)
    assert s["theta_behave_absdiff_max"] == pytest.approx(0.3, abs=1e-6)
    assert s["ratio_max"] == pytest.approx(2.0, abs=1e-6)


def test_alignment_through_pack_and_next_token_view():
    # Input alignment in the batch: token t's own values. The engine shifts them so the loss
    # sees, at position t, the values of token t+1 (what logprobs[t] is about).
    batch = SequenceBatch.from_token_lists(
        [[1, 2, 3]], loss_mask=[[0, 1, 1]], logprobs=[[0.0, -1.0, -2.0]], prox_logprobs=[[0.0, -1.0, -2.0]],
        advantages=[[0.0, 2.0, 3.0]],
    )
    mb = pack_sequences(batch, [0]).next_token_view()
    # logprobs[t] from the model: position 0 -> token 1 (-1.0), position 1 -> token 2 (-2.0).
    loss, grad = run(PPOConfig(), [-1.0, -2.0, 0.0], mb)
    assert loss == pytest.approx(-5.0) and grad.tolist() == pytest.approx([-2.0, -3.0, 0.0])


def test_value_loss_clipping():
    # V = [1.0, 0.0], V_old = [0.5, 0.5], R = [2.0, 0.45], eps 0.2:
    # tok0: V_clip = 0.5 + 0.2 = 0.7; (V-R)^2 = 1, (V_clip-R)^2 = 1.69 -> 1.69 / 2 = 0.845 (clipped)
    # tok1: V_clip = 0.5 - 0.2 = 0.3; (V-R)^2 = 0.2025, (V_clip-R)^2 = 0.0225 -> 0.10125
    # sum = 0.94625; grad tok0 = 0 (clipped branch is constant in V), tok1 = V - R = -0.45.
    v = torch.tensor([1.0, 0.0], requires_grad=True)
    loss, n_clip = value_loss(v, torch.tensor([0.5, 0.5]), torch.tensor([2.0, 0.45]), torch.tensor([1, 1]), 0.2)
    loss.backward()
    assert loss.item() == pytest.approx(0.94625, abs=1e-6) and n_clip.item() == 1
    assert v.grad.tolist() == pytest.approx([0.0, -0.45], abs=1e-6)
    stats: dict = {}
    mb = mb_of([3], values=[0.5, 0.5, 0.0], returns=[2.0, 0.45, 7.0], loss_mask=[1, 1, 0])
    out = ValueLoss(PPOConfig(value_eps_clip=0.2), stats)(torch.tensor([1.0, 0.0, 3.0]), mb)
    assert out.item() == pytest.approx(0.94625, abs=1e-6)
    assert summarize_stats(stats)["value_clip_frac"] == pytest.approx(0.5)


def test_kl_to_the_reference_in_the_loss():
    # On-policy (r = w = 1) with kl_in_loss, kl_ctl 0.1, k3: per token
    # loss_t = -A_t + 0.1 * (exp(lr - lp) - 1 - (lr - lp)), and d/d lp = -A_t + 0.1 * (1 - exp(lr - lp)).
    # tok0: lp -1, lr -1.5, A 1: d = 0.5; k3 = e^-0.5 - 0.5 = 0.10653066; grad = -1 + 0.1 * (1 - e^-0.5)
    # tok1: lp -2, lr -1, A 0: d = -1; k3 = e - 2 = 0.71828183;          grad = 0.1 * (1 - e)
    # tok2: masked (no loss, no KL).
    lp = [-1.0, -2.0, -0.3]
    mb = mb_of([3], logprobs=lp, prox_logprobs=lp, advantages=[1.0, 0.0, 5.0], ref_logprobs=[-1.5, -1.0, -9.0],
               loss_mask=[1, 1, 0])
    stats: dict = {}
    loss, grad = run(PPOConfig(kl_ctl=0.1, kl_estimator="k3", kl_in_loss=True), lp, mb, stats)
    k3 = [math.exp(-0.5) - 0.5, math.e - 2]
    assert loss == pytest.approx(-1.0 + 0.1 * sum(k3), abs=1e-6)
    assert grad.tolist() == pytest.approx([-1 + 0.1 * (1 - math.exp(-0.5)), 0.1 * (1 - math.e), 0.0], abs=1e-6)
    assert summarize_stats(stats)["kl_ref"] == pytest.approx(sum(k3) / 2, abs=1e-6)
    # The reward-side KL (kl_in_loss false) leaves the loss alone: it acts through the advantages.
    assert run(PPOConfig(kl_ctl=0.1, kl_estimator="k3"), lp, mb)[0] == pytest.approx(-1.0)
    with pytest.raises(KeyError, match="ref_logprobs"):
        run(PPOConfig(kl_ctl=0.1, kl_in_loss=True), lp, mb_of([3], logprobs=lp, prox_logprobs=lp, advantages=[1.0] * 3))

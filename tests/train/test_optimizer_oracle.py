"""`TrainEngine.train_batch` against an independent oracle (`tests.train.oracle`): the HF model
loaded by `transformers`, the loss written out per sequence, `torch.nn.utils.clip_grad_norm_` and
`torch.optim.AdamW`, the whole batch in one process. The other engine tests compare the engine with
itself (layouts, packings, resume); these catch a step that is wrong the same way everywhere.

The optimizer settings differ from every default on purpose (betas, weight decay 0.1, a clipping
threshold below the gradient norm, linear warmup over the first 2 of 4 steps), so a setting that
does not reach AdamW shows. Adam eps is 1e-4: a few gradient entries are nearly pure round-off
(which differs between a packed forward and a per-sequence one), and Adam divides them by about
eps, so a smaller eps magnifies the round-off into the weights whatever the step's correctness
(measured here, max |param diff| after each step: 3.6e-6 at eps 1e-8, 1.2e-6 at 1e-6, 2.8e-7 at
1e-5, 6e-8 at 1e-4). Adam's first step is also nearly invariant to the gradient's scale when eps
is far below the gradient entries, so this eps makes clipping visible from the first step.
"""

from __future__ import annotations

import math

import pytest
import torch

from tandem.train import TrainEngine
from tandem.train.config import OptimizerConfig
from tests.distributed import run_distributed
from tests.train.dist_workers import oracle_steps, split
from tests.train.helpers import (
    engine_config,
    full_params,
    make_batch,
    max_param_diff,
    rel_diff,
    weighted_loss,
)
from tests.train.oracle import OracleTrainer

PARAM_TOL = 1e-6
STAT_TOL = 1e-6  # relative, loss and gradient norm
OPTIMIZER = OptimizerConfig(lr=1e-3, beta1=0.8, beta2=0.95, eps=1e-4, weight_decay=0.1, gradient_clipping=1.0,
                            lr_scheduler="linear", warmup_steps_proportion=0.5)
TOTAL_STEPS = 4
# By hand from OptimizerConfig's meaning: warmup_steps = 0.5 * 4 = 2 and warmup's factor
# (step + 1) / warmup_steps, so the first step already moves, at half the peak rate.
LRS = [0.5e-3, 1e-3]


@pytest.fixture(scope="module")
def oracle(tiny_dir):
    """Two steps of the oracle on the whole batch: stats and weights after each step."""
    trainer = OracleTrainer(tiny_dir, OPTIMIZER)
    batch = make_batch(512)
    initial = trainer.params()
    stats, params = [], []
    for lr in LRS:
        stats.append(trainer.step(batch, lr))
        params.append(trainer.params())
    assert max_param_diff(params[0], initial) > 100 * PARAM_TOL  # the steps move far beyond the tolerance
    return stats, params


def _engine(tiny_dir) -> TrainEngine:
    return TrainEngine(engine_config(str(tiny_dir), optimizer=OPTIMIZER, total_train_steps=TOTAL_STEPS))


def _compare(label: str, stats: list[dict], params: list[dict], oracle) -> None:
    """The engine's per-step stats and weights (by HF name) against the oracle's."""
    ref_stats, ref_params = oracle
    for k, (s, ref, p, ref_p) in enumerate(zip(stats, ref_stats, params, ref_params, strict=True)):
        # Tied embeddings: the engine exports the one tensor once, HF's state dict under both names.
        assert set(p) <= set(ref_p) and set(ref_p) - set(p) <= {"lm_head.weight"}
        diff = max_param_diff(p, {n: ref_p[n] for n in p})
        print(f"\n[{label} step {k + 1}] loss {s['loss']:.8f} vs {ref['loss']:.8f}, grad norm {s['grad_norm']:.7f} "
              f"vs {ref['grad_norm']:.7f} (clipped to {OPTIMIZER.gradient_clipping}), lr {s['lr']:g}; "
              f"max |param diff| {diff:.2e}")
        assert ref["grad_norm"] > 1.5 * OPTIMIZER.gradient_clipping  # clipping really scales this step
        assert s["skipped"] == 0 and s["lr"] == LRS[k]
        assert rel_diff(s["loss"], ref["loss"]) <= STAT_TOL
        assert rel_diff(s["grad_norm"], ref["grad_norm"]) <= STAT_TOL
        assert diff <= PARAM_TOL, f"step {k + 1}: weights differ from the oracle's by {diff:.2e}"


def _optimizer_state(engine: TrainEngine) -> list[dict[str, torch.Tensor]]:
    """Each parameter's AdamW state (this rank's shard), cloned."""
    out = []
    for p in engine.model.parameters():
        state = engine.optimizer.state[p]
        out.append({k: (v.to_local() if hasattr(v, "to_local") else v).clone() for k, v in state.items()})
    return out


def test_two_steps_equal_transformers_and_torch_adamw(tiny_dir, oracle):
    """Catches a wrong update at world 1: the loss normalisation (token mean), gradient clipping
    (the norm or the scale), weight decay, betas, eps, or the learning rate of the first steps
    (warmup) differing from AdamW on the HF model with the same loss."""
    engine = _engine(tiny_dir)
    batch = make_batch(512)
    stats, params = [], []
    for _ in LRS:
        stats.append(engine.train_batch(batch, weighted_loss))
        params.append(full_params(engine))
    engine.close()
    _compare("world 1 vs oracle", stats, params, oracle)


def test_nonfinite_gradient_skips_the_step_and_leaves_no_trace(tiny_dir, oracle):
    """Catches a step taken, or optimizer state touched, on a non-finite gradient (a NaN
    advantage): the step must report skipped=1 and leave the weights and AdamW's exp_avg,
    exp_avg_sq and step count bit-identical; the next good step then equals the oracle's second
    step (no NaN or stale gradient carried over)."""
    engine = _engine(tiny_dir)
    batch = make_batch(512)
    first = engine.train_batch(batch, weighted_loss)
    before, state_before = full_params(engine), _optimizer_state(engine)
    poisoned = make_batch(512)
    poisoned.seqs[0]["advantages"][-1] = float("nan")  # the last token is always a loss token
    skipped = engine.train_batch(poisoned, weighted_loss)
    after, state_after = full_params(engine), _optimizer_state(engine)
    # A skipped step still advances the LR schedule: factor(2) of the linear schedule is 1.
    second = engine.train_batch(batch, weighted_loss)
    params = full_params(engine)
    engine.close()
    assert skipped["skipped"] == 1 and math.isnan(skipped["grad_norm"]) and math.isnan(skipped["loss"])
    moved = [n for n in before if not torch.equal(before[n], after[n])]
    assert not moved, f"a skipped step changed the weights {moved}"
    assert len(state_before) == len(state_after) > 0
    for i, (old, new) in enumerate(zip(state_before, state_after, strict=True)):
        assert old.keys() == new.keys() == {"step", "exp_avg", "exp_avg_sq"}
        changed = [k for k in old if not torch.equal(old[k], new[k])]
        assert not changed, f"a skipped step changed parameter {i}'s AdamW state {changed}"
    assert int(state_after[0]["step"]) == 1
    _compare("skip in between vs oracle", [first, second], [before, params], oracle)


@pytest.mark.slow
def test_world2_fsdp_two_steps_equal_the_oracle_on_the_whole_batch(tiny_dir, oracle):
    """Catches a data-parallel step that differs from one process on the whole batch: gradients
    averaged instead of summed (or a loss normalised per rank), a gradient norm of the local shard
    only (clipping by the wrong factor), or a sharded optimizer applied to the wrong slice; and a
    NaN on one rank's shard that only that rank skips (the ranks' weights would part)."""
    ranks = run_distributed(oracle_steps, 2, args=(str(tiny_dir), OPTIMIZER, TOTAL_STEPS), timeout=300)
    assert sorted(i for part in split(2) for i in part) == list(range(len(make_batch(512))))
    for rank, r in enumerate(ranks):
        _compare(f"world 2 rank {rank} vs oracle", r["stats"], r["params"], oracle)
        assert r["nan_step"]["skipped"] == 1
        moved = [n for n in r["after_nan"] if not torch.equal(r["after_nan"][n], r["params"][1][n])]
        assert not moved, f"rank {rank}: a NaN on the last rank's shard changed the weights {moved}"

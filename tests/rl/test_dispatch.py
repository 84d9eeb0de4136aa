"""Splitting a batch over data-parallel ranks by `actor.balance`: the cost chooses the partition,
the stats measure both costs, bad values are refused; and on real trainer ranks the configured
cost reaches the split of `TrainerModels.update`.

Hand case (hidden size 1, so the FLOP cost is 12·L + L²): lengths 10, 2, 4, 4, 4 on two ranks.
Tokens split perfectly only as {10, 2} / {4, 4, 4} (12 / 12 tokens); their FLOPs are
(120 + 100) + (24 + 4) = 248 against 3 · (48 + 16) = 192, mean 220. FLOPs split perfectly only as
{10} / {2, 4, 4, 4} (220 / 220), which is 10 / 14 tokens. The naive contiguous split {10, 2, 4} /
{4, 4} loads 16 / 8 tokens and 312 / 128 FLOPs.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from tandem.data.batch import SequenceBatch
from tandem.errors import ConfigError, ModelConfigError
from tandem.rl.config import load_run_config
from tandem.rl.dispatch import model_hidden_size, split_for_ranks

LENGTHS = [10, 2, 4, 4, 4]


def _batch(lengths: list[int]) -> SequenceBatch:
    return SequenceBatch([{"input_ids": torch.arange(n), "loss_mask": torch.ones(n, dtype=torch.long)}
                          for n in lengths])


def _held(shards: list[SequenceBatch]) -> list[list[int]]:
    return sorted(sorted(s.lengths) for s in shards)


def test_the_cost_chooses_the_split_and_the_stats_measure_both():
    """Catches: `cost` ignored (both runs would split alike), a metric measured in the wrong cost,
    the naive split's figures missing."""
    by_tokens, t = split_for_ranks(_batch(LENGTHS), 2, "tokens", hidden_size=1)
    by_flops, f = split_for_ranks(_batch(LENGTHS), 2, "flops", hidden_size=1)
    assert _held(by_tokens) == [[2, 10], [4, 4, 4]]
    assert _held(by_flops) == [[2, 4, 4, 4], [10]]
    assert t["dispatch/imbalance"] == t["dispatch/imbalance_tokens"] == 1.0
    assert t["dispatch/imbalance_flops"] == pytest.approx(248 / 220)
    assert f["dispatch/imbalance"] == f["dispatch/imbalance_flops"] == 1.0
    assert f["dispatch/imbalance_tokens"] == pytest.approx(14 / 12)
    for stats in (t, f):  # the naive split does not depend on the cost
        assert stats["dispatch/imbalance_naive_tokens"] == pytest.approx(16 / 12)
        assert stats["dispatch/imbalance_naive_flops"] == pytest.approx(312 / 220)
    assert t["dispatch/imbalance_naive"] == pytest.approx(16 / 12)
    assert f["dispatch/imbalance_naive"] == pytest.approx(312 / 220)


def test_one_rank_and_no_hidden_size():
    one, stats = split_for_ranks(_batch(LENGTHS), 1, "flops", hidden_size=1)
    assert one[0].lengths == LENGTHS
    assert stats == {f"dispatch/imbalance{kind}": 1.0 for kind in ("", "_naive", "_tokens", "_flops",
                                                                    "_naive_tokens", "_naive_flops")}
    # Without the model's hidden size only tokens can be measured (and balanced).
    _, stats = split_for_ranks(_batch(LENGTHS), 2)
    assert set(stats) == {"dispatch/imbalance", "dispatch/imbalance_naive", "dispatch/imbalance_tokens",
                          "dispatch/imbalance_naive_tokens"}


def test_bad_values_are_refused_naming_actor_balance():
    with pytest.raises(ValueError, match=r"cost='bytes' is not one of 'tokens', 'flops' \(actor.balance\)"):
        split_for_ranks(_batch(LENGTHS), 2, "bytes", hidden_size=1)
    with pytest.raises(ValueError, match=r"cost=\"flops\" needs the model's hidden_size"):
        split_for_ranks(_batch(LENGTHS), 2, "flops")
    with pytest.raises(ConfigError, match=r"actor.balance: 'bytes' is not one of 'tokens', 'flops'"):
        load_run_config(None, ["actor.balance=bytes"])
    assert load_run_config(None, ["actor.balance=flops"]).actor.balance == "flops"


def test_model_hidden_size_reads_config_json(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3", "hidden_size": 48}))
    assert model_hidden_size(str(tmp_path)) == 48
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
    with pytest.raises(ModelConfigError, match=r"no positive integer hidden_size \(got None\).*actor.balance"):
        model_hidden_size(str(tmp_path))


@pytest.mark.slow
def test_trainer_models_split_by_actor_balance(model_dir, tmp_path):
    """Catches `actor.balance` not reaching the split of a real step, or the controller measuring
    FLOPs with another hidden size than the model's. The tiny model has hidden size 64, so the FLOP
    cost is 768·L + L²; lengths 1000, 200, 400, 400, 400 (the hand case scaled by 100): tokens split
    {1000, 200} / {400, 400, 400} (1200 / 1200), whose FLOPs are 1,961,600 / 1,401,600 (mean
    1,681,600); FLOPs split {1000} / {200, 400, 400, 400}: 1,768,000 / 1,595,200, 1400 / 1000 tokens."""
    from tandem.data.trajectory import Trajectory
    from tandem.launch import LocalScheduler
    from tandem.rl.batch import build_training_batch
    from tandem.rl.models import start_models
    from tests.launch.procs import CHILD_ENV

    assert json.loads((model_dir / "config.json").read_text())["hidden_size"] == 64
    gen = torch.Generator().manual_seed(0)
    trajs = []
    for i, n in enumerate([1000, 200, 400, 400, 400]):
        prompt = torch.randint(3, 500, (4,), generator=gen).tolist()
        out = torch.randint(3, 500, (n - 4,), generator=gen).tolist()
        trajs.append(Trajectory.from_generation(prompt, out, [-6.2] * len(out), [0] * len(out),
                                                reward=float(i % 2), group_id="g0"))
    cfg = load_run_config(None, [f"actor.path={model_dir}", "actor.backend=archon:d2", "actor.num_threads=1"])
    sched = LocalScheduler(tmp_path / "run", env=CHILD_ENV, grace_s=10)
    try:
        models = start_models(cfg, sched)
        assert models.hidden_size == 64
        stats = {}
        for version, balance in enumerate(("tokens", "flops")):
            run = dataclasses.replace(cfg, actor=dataclasses.replace(cfg.actor, balance=balance))
            tb, _ = build_training_batch(trajs, run.algo, version=0)
            assert sorted(tb.batch.lengths) == [200, 400, 400, 400, 1000]
            stats[balance] = models.update(tb, run, version=version)
            assert stats[balance]["train/grad_norm"] > 0
        t, f = stats["tokens"], stats["flops"]
        assert t["dispatch/imbalance"] == t["dispatch/imbalance_tokens"] == 1.0
        assert t["dispatch/imbalance_flops"] == pytest.approx(1_961_600 / 1_681_600)
        assert f["dispatch/imbalance"] == f["dispatch/imbalance_flops"] == pytest.approx(1_768_000 / 1_681_600)
        assert f["dispatch/imbalance_tokens"] == pytest.approx(1400 / 1200)
    finally:
        sched.shutdown()

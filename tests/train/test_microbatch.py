"""Micro-batch planning, packing and order restoration (one process; the multi-rank agreement is
checked in test_engine_distributed.py)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tandem.config.fields import validate
from tandem.data.balance import sequence_cost
from tandem.data.batch import pack_sequences, shift_to_next_token
from tandem.errors import ConfigError
from tandem.train import MicroBatchConfig, SequenceBatch, plan_micro_batches, restore_order
from tandem.train.microbatch import build_micro_batches
from tests.train.helpers import make_batch

LENGTHS = [int(x) for x in torch.randint(1, 200, (60,), generator=torch.Generator().manual_seed(0))]


def _check_plan(plan, lengths, config):
    real = [p for p in plan if p]
    assert sorted(i for p in real for i in p) == list(range(len(lengths)))  # every index once
    if config.max_tokens_per_mb:
        assert all(sum(lengths[i] for i in p) <= config.max_tokens_per_mb for p in plan)
    assert len(plan) >= config.n_mbs and len(plan) % config.n_mbs_divisor == 0


@pytest.mark.parametrize("packing", ["ffd", "kk"])
@pytest.mark.parametrize(
    "budget,n_mbs,divisor", [(None, 1, 1), (None, 4, 1), (400, 1, 1), (400, 3, 4), (250, 1, 2), (199, 1, 1)]
)
def test_plans_respect_budget_and_counts(packing, budget, n_mbs, divisor):
    config = MicroBatchConfig(max_tokens_per_mb=budget, n_mbs=n_mbs, n_mbs_divisor=divisor, packing=packing)
    plan = plan_micro_batches(LENGTHS, config)
    _check_plan(plan, LENGTHS, config)
    if budget:
        assert len(plan) >= -(-sum(LENGTHS) // budget)
    else:
        assert len(plan) == max(n_mbs, 1)


def test_kk_is_more_even_than_ffd():
    spread = {}
    for packing in ("ffd", "kk"):
        plan = plan_micro_batches(LENGTHS, MicroBatchConfig(max_tokens_per_mb=1200, packing=packing))
        loads = [sum(LENGTHS[i] for i in p) for p in plan]
        spread[packing] = (len(plan), max(loads) - min(loads))
    assert spread["kk"][1] <= spread["ffd"][1]


def test_packing_choice_changes_the_plan():
    """Catches `actor.mb.packing` being ignored: under the same budget and count, first-fit
    decreasing fills micro-batches to the budget and leaves a small last one, Karmarkar-Karp
    evens them out."""
    loads = {}
    for packing in ("ffd", "kk"):
        plan = plan_micro_batches(LENGTHS, MicroBatchConfig(max_tokens_per_mb=1200, packing=packing))
        loads[packing] = sorted(sum(LENGTHS[i] for i in p) for p in plan)
    assert len(loads["ffd"]) == len(loads["kk"])
    assert loads["ffd"][-1] - loads["ffd"][0] > 500 and loads["kk"][-1] - loads["kk"][0] <= 1


def test_kk_packing_evens_the_balance_cost_under_the_token_budget():
    """Catches `actor.balance` not reaching micro-batch packing, or the budget checked in the cost
    instead of tokens. Hidden size 1: FLOP cost 12·L + L². Lengths 10, 2, 4, 4, 4 in two
    micro-batches: tokens even out only as {10, 2} / {4, 4, 4} (12 / 12), FLOPs only as
    {10} / {2, 4, 4, 4} (220 / 220). FFD packs by tokens whatever the cost."""
    lengths = [10, 2, 4, 4, 4]
    flops = sequence_cost(lengths, "flops", hidden_size=1)
    kk = MicroBatchConfig(max_tokens_per_mb=None, n_mbs=2, packing="kk")
    assert sorted(plan_micro_batches(lengths, kk)) == [[0, 1], [2, 3, 4]]
    assert sorted(plan_micro_batches(lengths, kk, costs=sequence_cost(lengths))) == [[0, 1], [2, 3, 4]]
    assert sorted(plan_micro_batches(lengths, kk, costs=flops)) == [[0], [1, 2, 3, 4]]
    # A budget of 13 tokens: {2, 4, 4, 4} (14 tokens) no longer fits, so a third micro-batch opens.
    budget = dataclasses.replace(kk, max_tokens_per_mb=13)
    plan = plan_micro_batches(lengths, budget, costs=flops)
    _check_plan(plan, lengths, budget)
    assert len(plan) == 3
    ffd = MicroBatchConfig(max_tokens_per_mb=12, packing="ffd")
    assert plan_micro_batches(lengths, ffd, costs=flops) == plan_micro_batches(lengths, ffd)
    with pytest.raises(ValueError, match="4 costs for 5 sequences"):
        plan_micro_batches(lengths, kk, costs=flops[:4])


def test_the_count_is_rounded_up_to_the_divisor():
    """Catches `actor.mb.n_mbs_divisor` being ignored: 3 micro-batches become 4 with divisor 4."""
    assert len(plan_micro_batches(LENGTHS, MicroBatchConfig(max_tokens_per_mb=None, n_mbs=3))) == 3
    assert len(plan_micro_batches(LENGTHS, MicroBatchConfig(max_tokens_per_mb=None, n_mbs=3, n_mbs_divisor=4))) == 4


def test_more_micro_batches_than_sequences_pads():
    plan = plan_micro_batches([5, 7], MicroBatchConfig(n_mbs=4))
    assert sorted(map(len, plan)) == [0, 0, 1, 1]
    assert plan_micro_batches([], MicroBatchConfig(n_mbs=2)) == [[], []]


def test_sequence_over_budget_is_an_error():
    with pytest.raises(ValueError, match="sequence 1 has 50 tokens"):
        plan_micro_batches([10, 50], MicroBatchConfig(max_tokens_per_mb=40))
    with pytest.raises(ConfigError, match="packing: 'zigzag' is not one of 'ffd', 'kk'"):
        validate(MicroBatchConfig(packing="zigzag"))


def test_pack_and_restore_order():
    batch = make_batch(100, lengths=[4, 9, 2, 6, 3])
    plan = plan_micro_batches(batch.lengths, MicroBatchConfig(max_tokens_per_mb=10))
    mbs = build_micro_batches(batch, plan)
    for mb in mbs:
        assert mb.input_ids.shape[0] == mb.cu_seqlens[-1] == mb.tokens["loss_mask"].shape[0]
        assert mb.scalars["reward"].shape == (len(mb.indices),)
        assert mb.lengths == [batch.lengths[i] for i in mb.indices]
    per_mb = [[(i, mb.input_ids[s:e].clone()) for i, s, e in zip(mb.indices, mb.cu_seqlens[:-1], mb.cu_seqlens[1:], strict=True)] for mb in mbs]
    restored = restore_order(mbs, per_mb, len(batch))
    assert [i for i, _ in restored] == list(range(len(batch)))
    assert all(torch.equal(ids, seq["input_ids"]) for (_, ids), seq in zip(restored, batch.seqs, strict=True))


def test_padding_micro_batch_and_next_token_view():
    pad = pack_sequences(make_batch(10, [3]), [])
    assert pad.is_padding and pad.n_tokens == 0 and pad.input_ids.shape == (1,)
    cu = torch.tensor([0, 3, 5], dtype=torch.int32)
    assert shift_to_next_token(torch.tensor([1, 2, 3, 4, 5]), cu).tolist() == [2, 3, 0, 5, 0]
    batch = SequenceBatch.from_token_lists([[1, 2, 3], [4, 5]], loss_mask=[[0, 1, 1], [1, 1]])
    view = pack_sequences(batch, [0, 1]).next_token_view()
    assert view.tokens["loss_mask"].tolist() == [1, 1, 0, 1, 0]


def test_batch_validation():
    with pytest.raises(ValueError, match="entries for 3 tokens"):
        SequenceBatch([{"input_ids": torch.tensor([1, 2, 3]), "loss_mask": torch.tensor([1, 1])}])
    with pytest.raises(ValueError, match="keys"):
        SequenceBatch([{"input_ids": torch.tensor([1])}, {"input_ids": torch.tensor([2]), "x": 1.0}])
    with pytest.raises(ValueError, match="non-empty"):
        SequenceBatch([{"input_ids": torch.tensor([], dtype=torch.long)}])

"""Bradley-Terry reward-model training on a value model (`TrainEngine(head="value")`).

A shard holds preference pairs laid out by `tandem.data.preferences.preference_batch`: sequence 2k
chosen, 2k+1 rejected, each with one loss position, its last real token, where the value head's
output is the pair member's score s. The loss of a pair is -log sigmoid(s_chosen - s_rejected),
averaged over every pair of every rank.

The update runs in two passes so that micro-batching may split a pair: a no-grad forward gives
every score, hence each pair's loss and the exact derivative of the mean loss by each score,
dL/ds_chosen = -sigmoid(s_rejected - s_chosen) / P = -dL/ds_rejected; then one optimizer step on
the linear surrogate sum_i (dL/ds_i) s_i, whose gradient in the weights equals the loss's (the
weights do not change between the passes). It costs one extra forward without backward."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tandem.data.batch import LOSS_MASK, MicroBatch, SequenceBatch
from tandem.train.dist import all_reduce_sum
from tandem.train.engine import TrainEngine

SCORE_GRAD = "score_grad"  # per token, input alignment: dL/ds of the sequence at its scored position


def pair_scores(engine: TrainEngine, shard: SequenceBatch) -> torch.Tensor:
    """`[P, 2]` float32: (chosen, rejected) scores of this rank's pairs. Collective."""
    if len(shard) % 2:
        raise ValueError(f"a preference shard holds pairs (chosen, rejected): got {len(shard)} sequences")
    values = engine.forward_values(shard, loss_tokens_only=True)
    scores = []
    for seq, v in zip(shard.seqs, values, strict=True):
        (positions,) = torch.nonzero(seq[LOSS_MASK][1:] > 0, as_tuple=True)  # prediction alignment
        if len(positions) != 1:
            raise ValueError(f"a preference sequence has one scored position (its loss mask's one 1), got {len(positions)}")
        scores.append(v[positions[0]])
    return torch.stack(scores).float().view(-1, 2) if scores else torch.zeros(0, 2)


def pair_stats(scores: torch.Tensor, engine: TrainEngine) -> dict[str, float]:
    """`reward/loss` (mean -log sigmoid(margin)), `reward/accuracy` (share of pairs with the chosen
    scored higher), `reward/margin` (mean chosen - rejected) and `reward/pairs`, over every rank."""
    margin = (scores[:, 0] - scores[:, 1]).double()
    n, loss, right, total = all_reduce_sum(
        [float(len(margin)), float(F.softplus(-margin).sum()), float((margin > 0).sum()), float(margin.sum())],
        engine.device, engine.dp_group)
    n_ = max(n, 1.0)
    return {"reward/loss": loss / n_, "reward/accuracy": right / n_, "reward/margin": total / n_, "reward/pairs": n}


def bradley_terry_update(engine: TrainEngine, shard: SequenceBatch) -> dict[str, float]:
    """One optimizer step of the mean pair loss over every rank's pairs; the `reward/*` stats of the
    scores before the step, `reward/grad_norm` and `reward/lr`. Collective."""
    scores = pair_scores(engine, shard)
    stats = pair_stats(scores, engine)
    margin = scores[:, 0] - scores[:, 1]
    d_chosen = (-torch.sigmoid(-margin)).tolist()  # per pair; the 1/P is the engine's normalisation
    for k, d in enumerate(d_chosen):
        for seq, grad in ((shard.seqs[2 * k], d), (shard.seqs[2 * k + 1], -d)):
            seq[SCORE_GRAD] = seq[LOSS_MASK].float() * grad
    try:
        result = engine.train_batch(shard, _surrogate, _pairs_in)
    finally:
        for seq in shard.seqs:
            seq.pop(SCORE_GRAD, None)
    return {**stats, "reward/grad_norm": result["grad_norm"], "reward/lr": result["lr"]}


def _surrogate(values: torch.Tensor, mb: MicroBatch) -> torch.Tensor:
    """sum over the micro-batch's scored positions of (dL/ds) * s."""
    return (values * mb.tokens[SCORE_GRAD].to(values.dtype) * mb.tokens[LOSS_MASK]).sum()


def _pairs_in(mb: MicroBatch) -> torch.Tensor:
    """A micro-batch's weight: its pairs (two scored positions each), so the step's gradient is the mean's."""
    return mb.tokens[LOSS_MASK].sum() / 2

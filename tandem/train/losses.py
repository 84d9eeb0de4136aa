"""The loss-function contract of `TrainEngine.train_batch`, and two simple instances.

A loss function gets the micro-batch's next-token `logprobs` and `entropy` (`[T]`, float32, with
grad) and the micro-batch in *prediction alignment* (`MicroBatch.next_token_view()`: position t
of every per-token value describes token t+1, the token `logprobs[t]` is about; last tokens 0).
It returns the SUM of its per-token (or per-sequence) losses over the micro-batch. When the batch
has a loss mask, `logprobs` and `entropy` are computed only where it is set (0 elsewhere): the
output head is skipped on prompt tokens, so a loss must not read other positions.

A loss-weight function returns the micro-batch's share of the normaliser (default: the number of
loss tokens). The engine divides every micro-batch's loss sum by the weights summed over all
micro-batches and all data-parallel ranks, so the optimised loss is a global token mean no matter
how the batch was split.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from tandem.data.batch import MicroBatch, loss_mask_of

LossFn = Callable[[torch.Tensor, torch.Tensor, MicroBatch], torch.Tensor]
# A value model's loss: the micro-batch's values (`[T]`, float32, with grad; prediction alignment,
# computed at the loss tokens) and the micro-batch; the same sum-and-normalise contract.
ValueLossFn = Callable[[torch.Tensor, MicroBatch], torch.Tensor]
LossWeightFn = Callable[[MicroBatch], float | torch.Tensor]


def sft_loss(logprobs: torch.Tensor, entropy: torch.Tensor, mb: MicroBatch) -> torch.Tensor:
    """Negative log-likelihood summed over loss tokens (supervised fine-tuning)."""
    del entropy
    return -(logprobs * loss_mask_of(mb)).sum()

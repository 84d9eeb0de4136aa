"""The loss-function contract of `TrainEngine.train_batch` (`LossFn`, `LossWeightFn`; a value
model's `ValueLossFn`) and one instance, `sft_loss`.

A loss function gets the next-token `logprobs` and `entropy` (`[T]`, float32, with grad; with a loss
mask only its positions are computed, so a loss must not read others) and the micro-batch in
*prediction alignment* (`MicroBatch.next_token_view()`), and returns the SUM of its losses. A
loss-weight function returns the micro-batch's share of the normaliser (default: its loss tokens);
the engine divides by the weights summed over all micro-batches and DP ranks: a global token mean
however the batch was split. See docs/training.md, "Training and losses"."""

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

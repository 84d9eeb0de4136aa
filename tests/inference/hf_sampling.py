"""Transformers' logits processors as an oracle for the sampler's filtered distribution."""

from __future__ import annotations

import torch
from transformers import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from tandem.inference.sampling_params import SamplingParams


def hf_filtered_probs(row: torch.Tensor, params: SamplingParams, input_ids: list[int]) -> torch.Tensor:
    """The distribution transformers' `generate` samples from for one row of raw logits: its logits
    processors in the order `generate` applies them (penalty, then temperature, top-k, top-p, min-p)."""
    ids = torch.tensor([input_ids])
    steps = []
    if params.repetition_penalty != 1.0:
        steps.append(RepetitionPenaltyLogitsProcessor(float(params.repetition_penalty)))
    if params.temperature != 1.0:
        steps.append(TemperatureLogitsWarper(float(params.temperature)))
    if params.vocab_top_k:
        steps.append(TopKLogitsWarper(params.vocab_top_k))
    if params.top_p < 1.0:
        steps.append(TopPLogitsWarper(params.top_p))
    if params.min_p:
        steps.append(MinPLogitsWarper(params.min_p))
    scores = row[None].double()
    for step in steps:
        scores = step(ids, scores)
    return scores.softmax(-1)[0]

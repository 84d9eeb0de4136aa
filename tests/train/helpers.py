"""Shared helpers of the training-engine tests (importable from spawned workers too)."""

from __future__ import annotations

from typing import Any

import torch

from tandem.train import MicroBatchConfig, SequenceBatch, TrainEngine, TrainEngineConfig
from tandem.train.config import OptimizerConfig

LENGTHS = [5, 17, 3, 30, 9, 12, 24, 2, 40, 7, 15, 11]


def make_batch(vocab_size: int, lengths: list[int] = LENGTHS, seed: int = 0) -> SequenceBatch:
    """Sequences with a prompt (no loss) then a response (loss), and a per-token advantage."""
    gen = torch.Generator().manual_seed(seed)
    seqs = []
    for n in lengths:
        prompt = int(torch.randint(0, max(1, n // 2), (), generator=gen))
        seqs.append(
            {
                "input_ids": torch.randint(0, vocab_size, (n,), generator=gen),
                "loss_mask": (torch.arange(n) >= prompt).long(),
                "advantages": torch.randn(n, generator=gen),
                "reward": torch.tensor(float(n % 3)),
            }
        )
    return SequenceBatch(seqs)


def weighted_loss(logprobs: torch.Tensor, entropy: torch.Tensor, mb) -> torch.Tensor:
    """Policy-gradient-like loss that uses per-token and per-sequence extras (and entropy)."""
    mask = mb.tokens["loss_mask"].float()
    seq_of_token = torch.repeat_interleave(
        torch.arange(len(mb.indices), device=logprobs.device), mb.cu_seqlens.diff().long()
    )
    reward = mb.scalars["reward"][seq_of_token]
    return -((mb.tokens["advantages"] + reward) * logprobs * mask).sum() - 0.01 * (entropy * mask).sum()


def engine_config(path: str, **overrides: Any) -> TrainEngineConfig:
    mb = overrides.pop("mb", MicroBatchConfig())
    optimizer = overrides.pop(
        "optimizer", OptimizerConfig(lr=1e-3, weight_decay=0.01, gradient_clipping=1.0)
    )
    return TrainEngineConfig(path=path, mb=mb, optimizer=optimizer, **overrides)


def full_params(engine: TrainEngine) -> dict[str, torch.Tensor]:
    """HF name -> full float32 tensor (collective on every rank)."""
    return {n: t.clone() for bucket in engine.export_weights(1 << 30, torch.float32) for n, t in bucket}


def train_steps(engine: TrainEngine, batch: SequenceBatch, steps: int = 3) -> list[dict[str, float]]:
    return [engine.train_batch(batch, weighted_loss) for _ in range(steps)]


def rel_diff(a: float, b: float) -> float:
    return abs(a - b) / max(abs(a), abs(b), 1e-12)


def max_param_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)

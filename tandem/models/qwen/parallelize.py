"""Parallelism plan for Qwen dense models (FSDP2 / TP / activation checkpointing / compile)."""

from __future__ import annotations

from typing import Any

from torch import nn


def parallelize_qwen(model: nn.Module, parallel_dims: Any, **options: Any) -> nn.Module:
    """Apply the parallel layout described by `parallel_dims` to `model` in place and return it.

    Placeholder: the training-engine work fills this in and sets `ModelSpec.parallelize`.
    """
    raise NotImplementedError(
        "parallelize_qwen is not implemented yet; run the model unsharded (single process) for now"
    )

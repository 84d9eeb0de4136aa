from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tandem.models.tiny import init_model


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """A tiny Qwen3 (tied embeddings) HF directory with its tokenizer."""
    return init_model(tmp_path_factory.mktemp("models") / "qwen3-tiny", arch="qwen3", preset="tiny", seed=0)


@pytest.fixture(autouse=True)
def _clean_process_state():
    """Engines in this process own a one-rank group; deterministic mode is process-wide."""
    torch.set_num_threads(2)
    yield
    if dist.is_initialized():
        dist.destroy_process_group()
    torch.use_deterministic_algorithms(False)


@pytest.fixture(scope="session")
def untied4_dir(tmp_path_factory):
    """The `tiny-untied` preset: a 4-layer Qwen3 with a separate output head (parallel layouts)."""
    return init_model(tmp_path_factory.mktemp("models") / "qwen3-tiny-untied", arch="qwen3", preset="tiny-untied",
                      seed=0)

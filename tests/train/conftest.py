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
    """The tiny preset with 4 layers and a separate output head (the parallel layouts' model)."""
    return init_model(tmp_path_factory.mktemp("models") / "qwen3-tiny-untied4", arch="qwen3", preset="tiny", seed=0,
                      overrides={"num_hidden_layers": 4, "tie_word_embeddings": False})


@pytest.fixture
def functorch_config():
    """torch's functorch config with `activation_memory_budget` restored after the test, by torch's
    own `patch`: pytest's monkeypatch cannot restore a torch config entry (its undo leaves the
    entry deleted, and every later read raises AttributeError)."""
    import torch._functorch.config as config

    with config.patch(activation_memory_budget=config.activation_memory_budget):
        yield config

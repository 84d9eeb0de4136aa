from __future__ import annotations

from pathlib import Path

import pytest

from tandem.models.tiny import init_model


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory) -> Path:
    """A tiny Qwen3 with its tokenizer, shared by the end-to-end runs."""
    return init_model(tmp_path_factory.mktemp("model") / "tiny", preset="tiny", seed=0)

from __future__ import annotations

import pytest

from tandem.models.tiny import init_model


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    return init_model(tmp_path_factory.mktemp("launch-models") / "qwen3-tiny", arch="qwen3", preset="tiny", seed=0)

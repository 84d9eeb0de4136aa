"""`tandem sft` under every model-parallel layout equals `archon:d1`, as a user runs it: per-step
loss within 1e-5 and grad norm within 1e-4 (relative), and the saved HF weights within 1e-5, on
an untied 4-layer tiny Qwen3 (3 steps of 8 sequences).

Every run uses 4 micro-batches per data-parallel rank (the pipeline needs at least as many as
its stages, and equal plans keep the comparison about the layout) and Adam eps 1e-6: with the
default 1e-8 a few gradient entries that are pure round-off (~1e-9) are divided by ~1e-8, so any
change of summation order moves their weights by up to the learning rate (d2 alone is 1.2e-4
from d1 then; the losses and gradients agree either way).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tandem.models.tiny import init_model
from tests.rl.sft_layouts import assert_equals_d1, sft_run

pytestmark = pytest.mark.slow
LAYOUTS = {  # name -> (actor.backend, actor.parallelize)
    "d2": ("archon:d2", {}),
    "t2": ("archon:t2", {}),
    "p2-1F1B": ("archon:p2", {"pp_schedule": "1F1B"}),
    "p2-I1F1B": ("archon:p2", {"pp_schedule": "I1F1B"}),
    "p2-IZB": ("archon:p2", {"pp_schedule": "IZB"}),
    "p2-ZBV": ("archon:p2", {"pp_schedule": "ZBV"}),
    "c2": ("archon:c2", {}),
    "d2t2": ("archon:d2t2", {}),
    "p2t2": ("archon:p2t2", {}),
    "d2c2": ("archon:d2c2", {}),
}


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return init_model(tmp_path_factory.mktemp("m") / "qwen3-4l-untied", preset="tiny", seed=0,
                      overrides={"num_hidden_layers": 4, "tie_word_embeddings": False})


@pytest.fixture(scope="module")
def reference(tmp_path_factory, model):
    return sft_run(tmp_path_factory.mktemp("ref") / "d1", model, "archon:d1")


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_sft_layout_equals_d1(tmp_path, model, reference, layout):
    assert_equals_d1(layout, sft_run(tmp_path / layout, model, *LAYOUTS[layout]), reference)

"""`tandem sft` of a tiny untied Qwen3-MoE under expert-parallel layouts equals `archon:d1`, as a
user runs it: per-step loss within 1e-5 and grad norm within 1e-4 (relative), and the saved HF
weights within 1e-5 (3 steps of 8 sequences; 8 experts, top-2, one dense layer among the MoE ones).
Layouts: plain and hybrid EP, ETP over the attention's TP pair, whole experts per TP rank (etp=1),
EP inside pipeline stages, experts FSDP-sharded over two ranks each (d4e2: edp=2), EP over the
context-parallel pair, and MoE parallel folding: experts split over the attention's TP (and CP)
ranks, down to the Archon document's `(attn:d1p4t2c2|ffn:d1p4t1e4)` at pipeline depth 2.

Same settings as tests/rl/test_parallel_sft.py (4 micro-batches per data-parallel rank, Adam eps
1e-6; see there why).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tandem.models.tiny import init_model
from tests.rl.sft_layouts import assert_equals_d1, sft_run

pytestmark = pytest.mark.slow
LAYOUTS = {  # name -> actor.backend
    "d2e2": "archon:d2e2",
    "hybrid-d2|e2": "archon:(attn:d2|ffn:e2)",
    "hybrid-d2t2|e2t2": "archon:(attn:d2t2|ffn:e2t2)",
    "d2t2e2": "archon:d2t2e2",
    "d2p2e2": "archon:d2p2e2",
    "d4e2": "archon:d4e2",
    "c2e2": "archon:c2e2",
    # MoE parallel folding (etp 1): the experts split over the attention's TP and CP ranks.
    "t2e2-folded": "archon:t2e2",
    "c2t2|e4-folded": "archon:(attn:c2t2|ffn:e4)",
    # The Archon document's flagship layout at half its pipeline depth (8 ranks).
    "d1p2t2c2|d1p2t1e4": "archon:(attn:d1p2t2c2|ffn:d1p2t1e4)",
}


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return init_model(tmp_path_factory.mktemp("m") / "qwen3-moe-untied", arch="qwen3_moe", preset="tiny", seed=0,
                      overrides={"num_hidden_layers": 3, "mlp_only_layers": [1], "tie_word_embeddings": False})


@pytest.fixture(scope="module")
def reference(tmp_path_factory, model):
    return sft_run(tmp_path_factory.mktemp("ref") / "d1", model, "archon:d1")


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_moe_sft_layout_equals_d1(tmp_path, model, reference, layout):
    assert_equals_d1(layout, sft_run(tmp_path / layout, model, LAYOUTS[layout]), reference)

"""Weight updates: all-or-nothing, validated before anything is swapped, prefix cache flushed."""

from __future__ import annotations

import pytest
import torch

from tandem.inference.engine import LLMEngine
from tandem.inference.errors import WeightUpdateError
from tandem.inference.sampling_params import SamplingParams
from tandem.models.hf_checkpoint import iter_hf_tensors
from tests.inference.conftest import make_model_dir, prompts

PARAMS = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
BATCH = prompts([20, 35, 6], seed=20)  # longer than a block, so the prefix cache holds them


@pytest.fixture(scope="module")
def new_dir(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("new"), "qwen3", seed=1)


def ids(outs):
    return [o.output_ids for o in outs]


def test_update_changes_outputs_to_the_new_weights_and_bad_updates_change_nothing(qwen3_dir, new_dir):
    engine = LLMEngine(qwen3_dir, kv_cache_tokens=1024, block_size=8)
    before = ids(engine.generate(BATCH, PARAMS))
    good = dict(iter_hf_tensors(new_dir))
    name = "model.layers.0.self_attn.q_proj.weight"
    bad_updates = {
        "shape": ({**good, name: good[name][:-1]}, f"{name!r} has shape"),
        "missing": ({k: v for k, v in good.items() if k != name}, f"missing tensor(s): {name}"),
        "unknown": ({**good, "model.layers.9.mlp.up_proj.weight": good[name]}, "unknown tensor 'model.layers.9"),
        "dtype": ({**good, name: good[name].to(torch.bfloat16)}, f"{name!r} has dtype torch.bfloat16"),
        "nan": ({**good, name: good[name].clone().fill_(float("nan"))}, f"tensor {name!r} holds NaN values"),
        "inf": ({**good, name: good[name].clone().index_fill_(1, torch.tensor([2]), float("-inf"))},
                f"tensor {name!r} holds inf values"),
    }
    for kind, (update, needle) in bad_updates.items():
        with pytest.raises(WeightUpdateError) as err:
            engine.load_weights(update.items(), weight_version=99)
        assert needle in str(err.value), kind
        assert engine.weight_version == 0
        assert ids(engine.generate(BATCH, PARAMS)) == before, kind

    engine.load_weights(iter_hf_tensors(new_dir), weight_version=2)
    assert engine.weight_version == 2 and engine.stats()["cached_blocks"] == 0
    after = engine.generate(BATCH, PARAMS)
    assert ids(after) == ids(LLMEngine(new_dir, kv_cache_tokens=1024, block_size=8).generate(BATCH, PARAMS))
    assert ids(after) != before and all(o.weight_version == 2 for o in after)
    assert engine.get_weights_by_name(name, truncate_size=5) == good[name].flatten()[:5].tolist()
    with pytest.raises(WeightUpdateError, match="no parameter named"):
        engine.get_weights_by_name("model.nope")


def test_non_strict_dtype_casts_floating_tensors(qwen3_dir, new_dir):
    engine = LLMEngine(qwen3_dir, kv_cache_tokens=512, block_size=8)
    update = [(n, t.to(torch.bfloat16)) for n, t in iter_hf_tensors(new_dir)]
    engine.load_weights(update, strict_dtype=False)
    name, tensor = update[0]
    assert engine.get_weights_by_name(name, 3) == tensor.float().flatten()[:3].tolist()

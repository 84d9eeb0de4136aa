"""Reading Qwen hyper-parameters from HF config dicts, and rejecting what is not supported."""

from __future__ import annotations

import pytest

from tandem.errors import ModelConfigError
from tandem.models import get_model_spec
from tandem.models.qwen import QwenArgs, parallelize_qwen

BASE = {
    "vocab_size": 100,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
}


def _args(model_type: str = "qwen3", **overrides) -> QwenArgs:
    return QwenArgs.from_hf_config({"model_type": model_type, **BASE, **overrides})


def test_defaults_follow_transformers():
    q2, q3 = _args("qwen2"), _args("qwen3")
    assert (q2.n_kv_heads, q2.head_dim, q2.qkv_bias, q2.o_bias, q2.qk_norm) == (4, 8, True, False, False)
    # transformers' Qwen3Config defaults head_dim to 128, not hidden / heads.
    assert (q3.n_kv_heads, q3.head_dim, q3.qkv_bias, q3.o_bias, q3.qk_norm) == (4, 128, False, False, True)
    assert _args("qwen3", attention_bias=True).o_bias is True
    assert q3.rope_theta == 10000.0 and not q3.tie_word_embeddings


def test_rope_theta_new_and_legacy_locations():
    assert _args(rope_parameters={"rope_type": "default", "rope_theta": 1e6}).rope_theta == 1e6
    assert _args("qwen2", rope_theta=5e5, rope_scaling=None).rope_theta == 5e5


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0}}, "rope_parameters"),
        ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "rope_scaling"),
        ({"use_sliding_window": True}, "use_sliding_window"),
        ({"layer_types": ["full_attention", "sliding_attention"]}, "layer_types"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"num_key_value_heads": 3}, "num_key_value_heads"),
    ],
)
def test_unsupported_features_name_the_field(overrides, field):
    with pytest.raises(ModelConfigError, match=field):
        _args(**overrides)


@pytest.mark.parametrize("key", sorted(BASE))
def test_missing_required_key_is_named(key):
    config = {"model_type": "qwen3", **BASE}
    del config[key]
    with pytest.raises(ModelConfigError, match=key):
        QwenArgs.from_hf_config(config)


def test_registry():
    assert get_model_spec("qwen2") is get_model_spec("qwen3")
    spec = get_model_spec("qwen3")
    assert spec.hf_architecture(_args("qwen3")) == "Qwen3ForCausalLM"
    assert spec.hf_architecture(_args("qwen2")) == "Qwen2ForCausalLM"
    assert get_model_spec("qwen3_moe").name == "qwen3_moe"
    with pytest.raises(ModelConfigError, match=r"'llama'.*supported: qwen2, qwen3, qwen3_moe"):
        get_model_spec("llama")
    assert spec.parallelize is parallelize_qwen

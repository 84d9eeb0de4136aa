"""Native model implementations, keyed by HF `model_type`, with HF checkpoint load and save.

Typical use:

    model = load_model("path/to/Qwen3-0.6B", dtype=torch.bfloat16)
    logits = model(input_ids, cu_seqlens)  # packed [T] tokens -> [T, vocab]
    save_model(model, "out/step-100", tokenizer_dir="path/to/Qwen3-0.6B")
"""

# Importing a family registers its ModelSpec.
from tandem.models import qwen as qwen
from tandem.models import qwen3_moe as qwen3_moe
from tandem.models.hf_checkpoint import read_hf_config
from tandem.models.loader import build_model, config_dtype, load_hf_weights, load_model, save_model
from tandem.models.registry import ModelSpec, get_model_spec, register_model_spec, supported_model_types

__all__ = [
    "ModelSpec",
    "build_model",
    "config_dtype",
    "get_model_spec",
    "load_hf_weights",
    "load_model",
    "read_hf_config",
    "register_model_spec",
    "save_model",
    "supported_model_types",
]

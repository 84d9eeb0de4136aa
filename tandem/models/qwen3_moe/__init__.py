"""Qwen3-MoE: the Qwen3 decoder (`QwenModel`) with mixture-of-experts feed-forwards."""

from tandem.models.qwen import QwenModel, parallelize_qwen, split_qwen
from tandem.models.qwen3_moe.args import MODEL_TYPES, Qwen3MoeArgs
from tandem.models.qwen3_moe.state_dict_adapter import Qwen3MoeStateDictAdapter
from tandem.models.registry import ModelSpec, register_model_spec
from tandem.models.value_head import CAUSAL_LM, VALUE_MODEL

QWEN3_MOE_SPEC = ModelSpec(
    name="qwen3_moe",
    model_types=MODEL_TYPES,
    args_from_hf_config=Qwen3MoeArgs.from_hf_config,
    model_cls=QwenModel,
    state_dict_adapter_cls=Qwen3MoeStateDictAdapter,
    hf_architecture=lambda args: "Qwen3Moe" + (VALUE_MODEL if args.value_head else CAUSAL_LM),
    parallelize=parallelize_qwen,
    pipeline_split=split_qwen,
)
register_model_spec(QWEN3_MOE_SPEC)

__all__ = ["QWEN3_MOE_SPEC", "Qwen3MoeArgs", "Qwen3MoeStateDictAdapter"]

"""Qwen2 and Qwen3 dense models (one family: same layout, Qwen3 adds per-head q/k norm)."""

from tandem.models.qwen.args import MODEL_TYPES, QwenArgs
from tandem.models.qwen.model import QwenModel
from tandem.models.qwen.parallelize import parallelize_qwen
from tandem.models.qwen.pipeline import split_qwen
from tandem.models.qwen.state_dict_adapter import QwenStateDictAdapter
from tandem.models.registry import ModelSpec, register_model_spec
from tandem.models.value_head import CAUSAL_LM, VALUE_MODEL


def _hf_architecture(args: QwenArgs) -> str:
    family = {"qwen2": "Qwen2", "qwen3": "Qwen3"}[args.model_type]
    return family + (VALUE_MODEL if args.value_head else CAUSAL_LM)


QWEN_SPEC = ModelSpec(
    name="qwen",
    model_types=MODEL_TYPES,
    args_from_hf_config=QwenArgs.from_hf_config,
    model_cls=QwenModel,
    state_dict_adapter_cls=QwenStateDictAdapter,
    hf_architecture=_hf_architecture,
    parallelize=parallelize_qwen,
    pipeline_split=split_qwen,
)
register_model_spec(QWEN_SPEC)

__all__ = ["QWEN_SPEC", "QwenArgs", "QwenModel", "QwenStateDictAdapter", "parallelize_qwen"]

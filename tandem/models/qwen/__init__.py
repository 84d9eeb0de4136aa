"""Qwen2 and Qwen3 dense models (one family: same layout, Qwen3 adds per-head q/k norm)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torch import nn

from tandem.models.qwen.args import MODEL_TYPES, QwenArgs
from tandem.models.qwen.model import QwenModel
from tandem.models.qwen.state_dict_adapter import QwenStateDictAdapter
from tandem.models.registry import ModelSpec, register_model_spec
from tandem.models.value_head import CAUSAL_LM, SEQUENCE_CLASSIFIER, VALUE_MODEL

if TYPE_CHECKING:
    import torch.distributed as dist

    from tandem.models.qwen.pipeline import HeadFn, QwenStage
    from tandem.parallel import ParallelDims
    from tandem.parallel.pipeline import PipelineLayout


# The parallelism modules load DTensor and the pipelining machinery: a second or more of start-up
# that a server (which never parallelizes a model) should not pay. They load at the first call.
def parallelize_qwen(model: nn.Module, parallel_dims: ParallelDims, **options: Any) -> nn.Module:
    """`tandem.models.qwen.parallelize.parallelize_qwen`, imported when first called."""
    from tandem.models.qwen.parallelize import parallelize_qwen as parallelize

    return parallelize(model, parallel_dims, **options)


def split_qwen(model: nn.Module, layout: PipelineLayout, pp_rank: int, head: HeadFn,
               cp_group: dist.ProcessGroup | None = None) -> list[QwenStage]:
    """`tandem.models.qwen.pipeline.split_qwen`, imported when first called."""
    from tandem.models.qwen.pipeline import split_qwen as split

    return split(model, layout, pp_rank, head, cp_group)


def _hf_architecture(args: QwenArgs) -> str:
    family = {"qwen2": "Qwen2", "qwen3": "Qwen3"}[args.model_type]
    return family + (VALUE_MODEL if args.value_head else SEQUENCE_CLASSIFIER if args.num_labels else CAUSAL_LM)


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

__all__ = ["QWEN_SPEC", "QwenArgs", "QwenModel", "QwenStateDictAdapter", "parallelize_qwen", "split_qwen"]

"""Registry of model families, keyed by the HF `model_type` found in `config.json`.

A family (e.g. `qwen/`, later `qwen3_moe/`) describes itself with a `ModelSpec` and registers it
when its package is imported; `tandem.models` imports every family.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import nn

from tandem.errors import ModelConfigError


@dataclass(frozen=True)
class ModelSpec:
    name: str
    model_types: tuple[str, ...]  # HF `model_type` values this family serves
    args_from_hf_config: Callable[[dict[str, Any]], Any]
    model_cls: type[nn.Module]  # constructed as model_cls(args, hf_config)
    state_dict_adapter_cls: type  # constructed as state_dict_adapter_cls(args)
    hf_architecture: Callable[[Any], str]  # args -> e.g. "Qwen3ForCausalLM"
    # parallelize(model, parallel_dims, **options) -> model; filled in by the training engine.
    parallelize: Callable[..., nn.Module] | None = None
    # pipeline_split(model, layout, pp_rank, head, cp_group) -> this rank's stage modules (pipeline
    # parallelism; each stage splits its tokens over `cp_group` under context parallelism).
    pipeline_split: Callable[..., list[nn.Module]] | None = None


_SPECS: dict[str, ModelSpec] = {}


def register_model_spec(spec: ModelSpec) -> None:
    for model_type in spec.model_types:
        existing = _SPECS.get(model_type)
        if existing is not None and existing.name != spec.name:
            raise ValueError(f"model_type {model_type!r} is already served by spec {existing.name!r}")
        _SPECS[model_type] = spec


def get_model_spec(model_type: str | None) -> ModelSpec:
    try:
        return _SPECS[model_type]  # type: ignore[index]
    except KeyError:
        raise ModelConfigError(
            f"unsupported model_type {model_type!r}; supported: {', '.join(supported_model_types())}"
        ) from None


def supported_model_types() -> list[str]:
    return sorted(_SPECS)

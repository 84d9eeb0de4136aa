"""Qwen3-MoE names: the dense Qwen names plus the router and the experts.

HF files hold one tensor per expert (`mlp.experts.{e}.gate_proj.weight` ...); the native model
stacks them (`moe.experts.w1[e]`), so each expert tensor is a *piece* of a native parameter
(see `tandem.models.state_dict_adapter`). Pieces are views: nothing is copied or transformed.
"""

from __future__ import annotations

import re

import torch

from tandem.errors import CheckpointError
from tandem.models.qwen.state_dict_adapter import QwenStateDictAdapter

_EXPERT_HF = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight")
_EXPERT_NATIVE = re.compile(r"layers\.(\d+)\.moe\.experts\.(w1|w2|w3)")
_ROUTER_HF = re.compile(r"model\.layers\.(\d+)\.mlp\.gate\.weight")
_ROUTER_NATIVE = re.compile(r"layers\.(\d+)\.moe\.router\.weight")
_PROJ_TO_NATIVE = {"gate_proj": "w1", "down_proj": "w2", "up_proj": "w3"}
_NATIVE_TO_PROJ = {v: k for k, v in _PROJ_TO_NATIVE.items()}


class Qwen3MoeStateDictAdapter(QwenStateDictAdapter):
    def hf_to_native(self, name: str) -> str | None:
        if match := _ROUTER_HF.fullmatch(name):
            return f"layers.{match.group(1)}.moe.router.weight"
        if _EXPERT_HF.fullmatch(name):
            raise CheckpointError(f"{name!r} is one expert of a stacked parameter; use hf_to_piece")
        return super().hf_to_native(name)

    def native_to_hf(self, name: str) -> str:
        if match := _ROUTER_NATIVE.fullmatch(name):
            return f"model.layers.{match.group(1)}.mlp.gate.weight"
        if _EXPERT_NATIVE.fullmatch(name):
            raise KeyError(f"{name!r} is stacked experts: several HF tensors (use pieces)")
        return super().native_to_hf(name)

    def hf_to_piece(self, name: str) -> tuple[str, int | None] | None:
        if match := _EXPERT_HF.fullmatch(name):
            layer, expert, proj = match.groups()
            if int(expert) >= self.args.num_experts:
                raise CheckpointError(f"unexpected tensor {name!r}: the model has {self.args.num_experts} experts")
            return f"layers.{layer}.moe.experts.{_PROJ_TO_NATIVE[proj]}", int(expert)
        return super().hf_to_piece(name)

    def pieces(self, native_name: str, shape: torch.Size | tuple[int, ...]) -> list[tuple[str, int | None]]:
        if match := _EXPERT_NATIVE.fullmatch(native_name):
            layer, weight = match.groups()
            proj = _NATIVE_TO_PROJ[weight]
            return [(f"model.layers.{layer}.mlp.experts.{e}.{proj}.weight", e) for e in range(shape[0])]
        return super().pieces(native_name, shape)

"""Routed experts on the client side: SGLang's `return_routed_experts` wire form, decoded into the
rows `Trajectory.routed_experts` holds, and spliced across the chunks of a resubmitted request.

Wire form (docs/inference.md, `/generate`): `meta_info["routed_experts"]` is the base64 of an int32
little-endian array `[prompt + output tokens - 1, num_hidden_layers, top_k]`: row t holds the
experts token t went through in every layer (a dense layer's entries are meaningless: -1 from
Tandem, 0 from SGLang; they are dropped here). The last token has no row: it was never forwarded.

Pure Python (no torch): rollout processes import this.
"""

from __future__ import annotations

import base64
import sys
from array import array
from dataclasses import dataclass
from pathlib import Path
from typing import Any

RoutedExperts = list[list[list[int]]]  # [tokens][moe layers][top_k]


@dataclass(frozen=True)
class RoutedExpertLayout:
    """What a MoE model's routed experts look like: `num_layers` on the wire's layer axis, `top_k` experts
    per token and layer, and the `moe_layers` kept (ascending block indices, the layer axis of
    `Trajectory.routed_experts`)."""

    num_layers: int
    top_k: int
    moe_layers: tuple[int, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "moe_layers", tuple(int(i) for i in self.moe_layers))
        if self.num_layers < 1 or self.top_k < 1 or not self.moe_layers:
            raise ValueError(f"a routed-expert layout needs layers, top_k >= 1 and MoE layers, got {self}")
        if any(not 0 <= i < self.num_layers for i in self.moe_layers):
            raise ValueError(f"moe_layers {list(self.moe_layers)} are not layers of a {self.num_layers}-layer model")

    @classmethod
    def of_args(cls, args: Any) -> RoutedExpertLayout | None:
        """The layout of a model's args (`n_layers`, `num_experts_per_tok`, `moe_layers`), None for a
        dense model."""
        layers = list(getattr(args, "moe_layers", []) or [])
        if not layers:
            return None
        return cls(int(args.n_layers), int(args.num_experts_per_tok), tuple(layers))

    @classmethod
    def of_model(cls, path: str | Path) -> RoutedExpertLayout | None:
        """The layout of the HF model directory `path` (its config.json), None for a dense model.
        Imports the model registry (and torch): call it in the launcher, not in rollout workers."""
        from tandem.models import get_model_spec, read_hf_config  # torch: rollout workers need none

        cfg = read_hf_config(path)
        return cls.of_args(get_model_spec(cfg.get("model_type")).args_from_hf_config(cfg))

    def unknown_row(self) -> list[list[int]]:
        return [[-1] * self.top_k for _ in self.moe_layers]


def decode_routed_experts(encoded: str, num_rows: int, layout: RoutedExpertLayout) -> RoutedExperts:
    """`meta_info["routed_experts"]` -> `num_rows` rows of `[moe layers][top_k]` expert ids (the MoE
    layers of `layout`, in its order). ValueError if the payload does not hold `num_rows` rows of
    `[layout.num_layers, layout.top_k]` int32."""
    try:
        raw = base64.b64decode(encoded, validate=True)
    except (ValueError, TypeError) as exc:
        raise ValueError(f"meta_info.routed_experts is not base64: {exc}") from exc
    width = layout.num_layers * layout.top_k
    if len(raw) != 4 * num_rows * width:
        raise ValueError(f"meta_info.routed_experts holds {len(raw)} bytes; {num_rows} tokens x "
                         f"{layout.num_layers} layers x top_k {layout.top_k} int32 need {4 * num_rows * width} "
                         "(does the routed-expert layout match the served model?)")
    flat = array("i")
    assert flat.itemsize == 4
    flat.frombytes(raw)
    if sys.byteorder == "big":
        flat.byteswap()
    k = layout.top_k
    return [[flat[(t * layout.num_layers + layer) * k:(t * layout.num_layers + layer + 1) * k].tolist()
             for layer in layout.moe_layers] for t in range(num_rows)]


def is_known(row: list[list[int]]) -> bool:
    return all(e >= 0 for experts in row for e in experts)


def splice_routed_experts(known: RoutedExperts, new: RoutedExperts) -> RoutedExperts:
    """Routed experts of one sequence merged over its chunks: a resubmitted request's answer covers its
    whole prefix again (the server reads them from the KV that produced its tokens, recomputed
    or cached), so `new` wins wherever it knows a row; `known` fills the rows `new` lacks or left
    unknown (-1: e.g. a chunk aborted while queued)."""
    out = [row if is_known(row) or t >= len(known) else known[t] for t, row in enumerate(new)]
    return out + known[len(new):]

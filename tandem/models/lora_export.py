"""`export_merged`: an HF model directory of a base model with a PEFT LoRA adapter merged in
(`W + alpha / r * B @ A`, float32 math, each tensor in the base's dtype), streamed tensor by tensor
(`tandem export-merged`). transformers loads the result as a plain model."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import torch

from tandem.errors import CheckpointError
from tandem.models.common.lora import AdapterSpec, merged_weight, parse_peft_name, read_adapter
from tandem.models.hf_checkpoint import (
    iter_hf_tensors,
    read_hf_config,
    read_tensor_shapes,
    save_hf_checkpoint_stream,
)


def export_merged(base_dir: str | os.PathLike[str], adapter_dir: str | os.PathLike[str],
                  out_dir: str | os.PathLike[str], *, overwrite: bool = False) -> Path:
    """Write `base_dir` with the adapter at `adapter_dir` merged into `out_dir` (config and
    tokenizer files of the base). CheckpointError when an adapter tensor names a module the base
    lacks or a pair is incomplete; nothing is written then."""
    spec = AdapterSpec.read(adapter_dir)
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in read_adapter(adapter_dir).items():
        module, side = parse_peft_name(name)
        pairs.setdefault(f"{module}.weight", {})[side] = tensor
    incomplete = sorted(w for w, sides in pairs.items() if len(sides) != 2)
    if incomplete:
        raise CheckpointError(f"adapter {str(adapter_dir)!r} lacks lora_A or lora_B for {incomplete[:3]}")
    names = read_tensor_shapes(base_dir).keys()  # the headers only: the tensors are read once, below
    unknown = sorted(pairs.keys() - names)
    if unknown:
        raise CheckpointError(f"adapter {str(adapter_dir)!r} adapts {unknown[:3]}, which base {str(base_dir)!r} "
                              "does not hold: was it trained on another model?")

    def tensors() -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in iter_hf_tensors(base_dir):
            sides = pairs.get(name)
            yield name, tensor if sides is None else merged_weight(tensor, sides["A"], sides["B"], spec.scale)

    return save_hf_checkpoint_stream(out_dir, read_hf_config(base_dir), tensors(), tokenizer_dir=base_dir,
                                     overwrite=overwrite)

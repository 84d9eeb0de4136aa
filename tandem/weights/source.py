"""`WeightSource`: what a weight update needs from the trainer (a `TrainEngine` implements it).
Under LoRA it exports either the adapters alone (PEFT names; `WeightUpdateMeta.lora_alpha` set,
the trainer told so before the first update) or the merged whole weights.

`export_weights` and `save_hf` are collectives: every trainer rank calls them, in the same order.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Protocol

import torch

Bucket = list[tuple[str, torch.Tensor]]

# Where a bucket's full tensors go: (HF names, shapes, dtype, device), one per HF tensor (piece) ->
# one tensor per name to write into, or None to let the export allocate them.
Alloc = Callable[[list[str], list[torch.Size], torch.dtype, torch.device], "list[torch.Tensor] | None"]


class WeightSource(Protocol):
    @property
    def param_dtype(self) -> torch.dtype | None:
        """The dtype weights travel in unless the update asks for another (None: each tensor's own)."""
        ...

    def export_weights(self, bucket_bytes: int, dtype: torch.dtype | None = None, alloc: Alloc | None = None,
                       dst: int | None = None) -> Iterator[Bucket]:
        """Buckets of `(hf_name, full tensor)` of at most `bucket_bytes` (a larger tensor travels
        alone), cast to `dtype`, written into `alloc`'s tensors when it gives some, complete on
        rank `dst` only when given. Collective."""
        ...

    def local_weights(self) -> list[Bucket] | None:
        """Per parameter in export order, its `(hf_name, tensor)` HF pieces (views of the whole
        parameter, uncast), when this process holds every parameter whole (one trainer rank); None
        otherwise. Lets an update cast straight into its send memory without a gather."""
        ...

    def export_nbytes(self, dtype: torch.dtype | None) -> int | None:
        """About how many bytes an export in `dtype` takes (each tensor 64-byte aligned), or None."""
        ...

    def save_hf(self, out_dir: str | Path, *, overwrite: bool = False) -> Path:
        """The current weights as an HF directory (written completely before it appears), or the
        LoRA adapter as a PEFT directory when updates carry adapters. Collective."""
        ...

"""Routed experts per KV slot: which experts each cached token went through in every MoE layer.

`RoutedExpertCache` holds one `[num_blocks + 1, block_size, moe_layers, top_k]` tensor of expert
ids (-1 = never written), written at each forward's slot mapping and copied with the blocks, so
the ids live exactly as long as the KV they came with; a finished request's are read through its
block table. Dense models have none (`RoutedExpertCache.for_model` returns None). See
docs/inference.md, "Routed experts (MoE models)"."""

from __future__ import annotations

import torch
from torch import nn

from tandem.models.common.moe import Routing


class RoutedExpertCache:
    def __init__(self, num_layers: int, moe_layers: list[int], top_k: int, num_experts: int, num_blocks: int,
                 block_size: int, device: torch.device):
        self.num_layers = num_layers
        self.moe_layers = list(moe_layers)
        self.top_k = top_k
        self.block_size = block_size
        dtype = torch.int16 if num_experts <= torch.iinfo(torch.int16).max else torch.int32
        self.ids = torch.full((num_blocks + 1, block_size, len(self.moe_layers), top_k), -1, dtype=dtype,
                                 device=device)

    @classmethod
    def for_model(cls, model: nn.Module, num_blocks: int, block_size: int,
                  device: torch.device) -> RoutedExpertCache | None:
        """A routed-expert cache for a MoE model (its args list `moe_layers`), None for a dense one."""
        args = model.args
        layers = list(getattr(args, "moe_layers", []) or [])
        if not layers:
            return None
        return cls(int(args.n_layers), layers, int(args.num_experts_per_tok), int(args.num_experts), num_blocks, block_size, device)

    def routing(self) -> Routing:
        """The `Routing` to pass to a forward whose expert ids `write` then stores."""
        return Routing(record=True)

    def write(self, routing: Routing, slot_mapping: torch.Tensor) -> None:
        """Store the expert ids a forward recorded for its `[T]` tokens at their KV slots."""
        num_tokens = slot_mapping.shape[0]
        # The model may pad the token count (token_multiple); the padding's rows are dropped.
        ids = torch.stack([routing.recorded[layer][:num_tokens] for layer in self.moe_layers], dim=1)
        flat = self.ids.view(-1, len(self.moe_layers), self.top_k)
        flat[slot_mapping] = ids.to(flat.dtype)

    def copy_blocks(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        self.ids[dst] = self.ids[src]

    def clear_blocks(self, block_ids: torch.Tensor) -> None:
        self.ids[block_ids] = -1

    def read(self, block_table: list[int], num_tokens: int) -> torch.Tensor:
        """`[num_tokens, num_layers, top_k]` int32 (CPU) expert ids of a sequence's first `num_tokens`
        positions, read through its block table, on the model's whole layer axis (SGLang's
        layout): dense layers, and positions past the sequence's blocks, are -1."""
        out = torch.full((num_tokens, self.num_layers, self.top_k), -1, dtype=torch.int32)
        known = min(num_tokens, len(block_table) * self.block_size)
        if known > 0:
            blocks = torch.tensor(block_table, dtype=torch.long, device=self.ids.device)
            ids = self.ids[blocks].reshape(-1, len(self.moe_layers), self.top_k)[:known]
            out[:known, self.moe_layers] = ids.to("cpu", torch.int32)
        return out

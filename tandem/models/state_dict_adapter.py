"""The contract between a family's native parameter names and the tensors of an HF checkpoint.

Most native parameters are one HF tensor each. Some are several: a mixture-of-experts layer keeps
its experts stacked (`[num_experts, out, in]`, one matmul for all of them) where HF files hold one
tensor per expert. Such a native parameter is made of *pieces*: `(hf_name, index)` says that HF
tensor `hf_name` is `param[index]`; `index` is None for a parameter that is one whole tensor.
Every reader and writer of HF tensors (loading, saving, weight export and receive) goes through the
piece methods, so a family with stacked parameters needs nothing else.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

Piece = tuple[str, int | None]  # (HF tensor name, index along dim 0 of the native parameter or None)


def piece_shape(shape: torch.Size | tuple[int, ...], index: int | None) -> torch.Size:
    """The shape of piece `index` of a native parameter of `shape` (the whole shape when None)."""
    return torch.Size(shape if index is None else shape[1:])


class StateDictAdapter(ABC):
    @abstractmethod
    def hf_to_native(self, name: str) -> str | None:
        """Native name of an HF tensor that is a whole parameter; None for tensors to skip. Raises
        `CheckpointError` for a name the family does not know (or that is a piece: `hf_to_piece`)."""

    @abstractmethod
    def native_to_hf(self, name: str) -> str:
        """HF name of a native parameter that is one HF tensor; KeyError otherwise."""

    def hf_to_piece(self, name: str) -> tuple[str, int | None] | None:
        """(native name, index) of an HF tensor: `param[index]` is it (index None: the whole
        parameter). None for tensors to skip. Raises `CheckpointError` for an unknown name."""
        native = self.hf_to_native(name)
        return None if native is None else (native, None)

    def pieces(self, native_name: str, shape: torch.Size | tuple[int, ...]) -> list[Piece]:
        """The HF tensors that make up native parameter `native_name` of `shape`, in file order."""
        return [(self.native_to_hf(native_name), None)]

    def to_hf(self, native_sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """HF tensors of a native state dict (pieces are views of their parameter)."""
        out: dict[str, torch.Tensor] = {}
        for name, tensor in native_sd.items():
            for hf_name, index in self.pieces(name, tensor.shape):
                out[hf_name] = tensor if index is None else tensor[index]
        return out

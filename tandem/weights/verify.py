"""Checksums that let a trainer verify what its servers hold after an update (data plane)."""

from __future__ import annotations

import hashlib

import torch


def tensor_checksum(tensor: torch.Tensor) -> str:
    """sha256 (hex) of a tensor's bytes: C order, its own dtype, computed on the CPU."""
    flat = tensor.detach().contiguous().reshape(-1).cpu()
    return hashlib.sha256(flat.view(torch.uint8).numpy().data).hexdigest()


def compare_checksums(expected: dict[str, str], served: dict[str, str]) -> list[str]:
    """Names whose checksum differs or that one side lacks (sorted)."""
    return sorted(n for n in expected.keys() | served.keys() if expected.get(n) != served.get(n))

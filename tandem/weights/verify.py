"""Checksums that let a trainer verify what its servers hold after an update (data plane), and
rank 0's bookkeeping of them during one update (`UpdateVerifier`)."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from pathlib import Path

import torch

from tandem.fleet import ops
from tandem.fleet.interface import Fleet, call
from tandem.fleet.results import FleetError, ServerChecksums, ServerResult
from tandem.models.common.lora import PEFT_PREFIX
from tandem.models.hf_checkpoint import iter_hf_tensors
from tandem.weights.group import dtype_from_name


def tensor_checksum(tensor: torch.Tensor) -> str:
    """sha256 (hex) of a tensor's bytes: C order, its own dtype, computed on the CPU."""
    flat = tensor.detach().contiguous().reshape(-1).cpu()
    return hashlib.sha256(flat.view(torch.uint8).numpy().data).hexdigest()


def compare_checksums(expected: dict[str, str], served: dict[str, str]) -> list[str]:
    """Names whose checksum differs or that one side lacks (sorted)."""
    return sorted(n for n in expected.keys() | served.keys() if expected.get(n) != served.get(n))


class UpdateVerifier:
    """The trainer's checksums of what it sends, in each dtype the servers serve, compared with
    every server's after the commit. Failures come back as `FleetError` (naming the servers)."""

    def __init__(self, fleet: Fleet):
        self.fleet = fleet
        self.sums: dict[str, dict[str, str]] = {}  # served dtype -> name -> sha256

    def prepare(self) -> None:
        """Learn which dtypes the servers serve (no tensors hashed). Raises `FleetError`."""
        self.sums = {}
        self.sums = {s.dtype: {} for s in self._served(()).values()}

    def add(self, bucket: Sequence[tuple[str, torch.Tensor]]) -> None:
        for dtype_name, sums in self.sums.items():
            dtype = dtype_from_name(dtype_name)
            for name, t in bucket:
                sums[name] = tensor_checksum(t.to(dtype))

    def add_checkpoint(self, path: Path) -> None:
        self.add(list(iter_hf_tensors(path)))

    def check(self) -> None:
        """Compare with every server. Raises `FleetError` naming each server that differs. A LoRA
        adapter's tensors are compared by name (the servers hold whole weights besides them)."""
        sent = {n for sums in self.sums.values() for n in sums}
        served = self._served(tuple(sorted(sent)) if any(n.startswith(PEFT_PREFIX) for n in sent) else None)
        bad = []
        for address, got in served.items():
            wrong = compare_checksums(self.sums.get(got.dtype, {}), got.checksums)
            if wrong:
                bad.append(ServerResult(address, False, f"{len(wrong)} tensor(s) differ from the trainer's, "
                                                        f"e.g. {wrong[:3]}"))
        if bad:
            raise FleetError("verify", bad)

    def _served(self, names: tuple[str, ...] | None) -> dict[str, ServerChecksums]:
        return call(self.fleet, ops.CHECKSUMS, ops.ChecksumsRequest(names)).values()

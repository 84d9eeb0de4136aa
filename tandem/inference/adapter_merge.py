"""Serving LoRA adapters by merging them into the base weights (`AdapterMerger`).

An adapter update names PEFT tensors (`base_model.model.<module>.lora_A.weight`, `lora_B`); the
server turns it into whole weights `W = W_base + (alpha / r) * B @ A` (float32 math, cast to the
served dtype) for every adapted module and swaps those in like any partial update. `W_base` is a
copy of each module's weight taken the first time an adapter touches it, so every update merges
from the base (no drift over updates), and a module the previous adapter adapted but this one does
not gets its base back. The cost: one copy of the adapted weights, and one `B @ A` per module per
update; decoding runs at the base model's speed (docs/lora.md, "How sync works")."""

from __future__ import annotations

import torch
from torch import nn

from tandem.errors import CheckpointError
from tandem.inference.errors import WeightUpdateError
from tandem.inference.weight_swap import served_tensor
from tandem.models.common.lora import PEFT_PREFIX, merged_weight, parse_peft_name
from tandem.weights.verify import tensor_checksum


def is_adapter_update(names: list[str] | tuple[str, ...]) -> bool:
    """Whether an update's tensors are a LoRA adapter (PEFT names), not weights. Mixed sets are
    refused by the checks that follow (an adapter name is no weight, and the reverse)."""
    return bool(names) and names[0].startswith(PEFT_PREFIX)


class AdapterMerger:
    """The base copies of adapted weights and the adapter now merged into them, of one server."""

    def __init__(self) -> None:
        self.base: dict[str, torch.Tensor] = {}  # HF weight name -> its base value (served dtype)
        self.adapter: dict[str, torch.Tensor] = {}  # PEFT name -> tensor of the adapter now served

    @staticmethod
    def modules(named: list[tuple[str, torch.Tensor]]) -> dict[str, dict[str, torch.Tensor]]:
        """HF module -> {"A": lora_A, "B": lora_B} of an adapter's tensors; WeightUpdateError for a
        name that is not a PEFT LoRA tensor or a tensor sent twice."""
        out: dict[str, dict[str, torch.Tensor]] = {}
        for name, tensor in named:
            try:
                module, side = parse_peft_name(name)
            except CheckpointError as exc:
                raise WeightUpdateError(f"adapter update: {exc}") from None
            if side in out.setdefault(module, {}):
                raise WeightUpdateError(f"adapter update sends tensor {name!r} twice")
            out[module][side] = tensor
        return out

    @staticmethod
    def check(model: nn.Module, named: list[tuple[str, torch.Tensor]], partial: bool = False) -> None:
        """Names and shapes of adapter tensors (meta tensors are fine) against `model`: each a
        PEFT LoRA tensor of a linear weight of the model, `lora_A` `[r, in]`, `lora_B` `[out, r]`,
        one rank for all; with `partial` (one bucket of a staged set) a module's A and B may
        arrive in different buckets. WeightUpdateError naming the first bad tensor."""
        ranks = set()
        for module, sides in AdapterMerger.modules(named).items():
            weight = f"{module}.weight"
            try:
                out_features, in_features = served_tensor(model, weight).shape
            except (WeightUpdateError, ValueError):
                raise WeightUpdateError(f"adapter update: {module!r} is no linear weight of this "
                                        f"{model.args.model_type} model") from None
            if not partial and len(sides) != 2:
                raise WeightUpdateError(f"adapter update: {module!r} has lora_{''.join(sides)} but not its pair")
            a, b = sides.get("A"), sides.get("B")
            if a is not None and (a.dim() != 2 or a.shape[1] != in_features):
                raise WeightUpdateError(f"adapter update: {module}.lora_A has shape {tuple(a.shape)}, expected "
                                        f"[r, {in_features}]")
            if b is not None and (b.dim() != 2 or b.shape[0] != out_features):
                raise WeightUpdateError(f"adapter update: {module}.lora_B has shape {tuple(b.shape)}, expected "
                                        f"[{out_features}, r]")
            ranks.update({a.shape[0]} if a is not None else set())
            ranks.update({b.shape[1]} if b is not None else set())
            if not all(t.is_floating_point() for t in sides.values()):
                raise WeightUpdateError(f"adapter update: {module} tensors must be floating point")
        if len(ranks) > 1:
            raise WeightUpdateError(f"adapter update mixes ranks {sorted(ranks)}; one adapter has one rank")

    def merged(self, model: nn.Module, named: list[tuple[str, torch.Tensor]], alpha: float
               ) -> list[tuple[str, torch.Tensor]]:
        """The whole weights that serve adapter `named` (a full set, `check`ed) with `alpha`: one
        per adapted module, and the base of every module an earlier adapter adapted and this one
        does not. Takes the base copies it lacks (before anything is swapped). Raises
        WeightUpdateError."""
        if not alpha > 0:
            raise WeightUpdateError(f"adapter update: lora_alpha must be positive, got {alpha}")
        self.check(model, named)
        modules = self.modules(named)
        out = []
        for module, sides in modules.items():
            weight = f"{module}.weight"
            if weight not in self.base:
                self.base[weight] = served_tensor(model, weight).detach().clone()
            a, b = sides["A"], sides["B"]
            out.append((weight, merged_weight(self.base[weight], a.to(self.base[weight].device),
                                              b.to(self.base[weight].device), alpha / a.shape[0])))
        adapted = {f"{m}.weight" for m in modules}
        out += [(w, base.clone()) for w, base in self.base.items() if w not in adapted]
        return out

    def served(self, named: list[tuple[str, torch.Tensor]]) -> None:
        """Adapter `named` is now merged in (its swap succeeded): remember it for checksums."""
        self.adapter = {n: t.detach().clone() for n, t in named}

    def replaced(self, names: list[str], full: bool) -> None:
        """Whole weights were swapped in. A full set is a new base: the copies and the adapter go.
        A partial one must not touch an adapted weight while an adapter is merged (its base would
        be unknown): call before the swap; WeightUpdateError then."""
        if full:
            self.base, self.adapter = {}, {}
            return
        touched = sorted(set(names) & self.base.keys())
        if touched and self.adapter:
            raise WeightUpdateError(f"a partial weight update of {touched[:3]} while a LoRA adapter is merged into "
                                    "them; send the whole weights or an adapter")
        for name in touched:  # no adapter merged: what arrives is the base; copied again when next adapted
            del self.base[name]

    def checksums(self, names: list[str] | None) -> dict[str, str]:
        """PEFT name -> sha256 of the adapter now served (among `names` when given)."""
        return {n: tensor_checksum(t) for n, t in self.adapter.items() if names is None or n in names}

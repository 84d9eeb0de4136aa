"""AdamW, the learning-rate schedule, and gradient clipping that is correct for sharded grads."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch.distributed.tensor import DTensor

from tandem.train.config import OptimizerConfig

SCHEDULES = ("constant", "linear", "cosine")


def build_optimizer(
    params: Iterable[torch.nn.Parameter], config: OptimizerConfig, device_type: str
) -> torch.optim.AdamW:
    """AdamW with the fused kernel on accelerators and the multi-tensor (foreach) one on CPU."""
    fused = device_type != "cpu"
    return torch.optim.AdamW(
        list(params),
        lr=config.lr,
        betas=(config.beta1, config.beta2),
        eps=config.eps,
        weight_decay=config.weight_decay,
        fused=fused or None,
        foreach=None if fused else True,
    )


class LRSchedule:
    """lr(step) = base_lr * factor(step); `step` counts optimizer steps taken so far.

    Warmup: factor = (step + 1) / warmup_steps for the first warmup_steps steps (the first step
    already moves). Then `constant` stays at 1; `linear` and `cosine` decay from 1 at the end of
    warmup to `min_lr_ratio` at `total_steps`, and stay there.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        kind: str = "constant",
        total_steps: int = 1,
        warmup_steps: int = 0,
        min_lr_ratio: float = 0.0,
    ):
        if kind not in SCHEDULES:
            raise ValueError(f"lr schedule {kind!r}; choose one of {', '.join(SCHEDULES)}")
        self.optimizer = optimizer
        self.kind = kind
        self.total_steps = max(1, total_steps)
        self.warmup_steps = max(0, warmup_steps)
        self.min_lr_ratio = min_lr_ratio
        self.base_lrs = [group["lr"] for group in optimizer.param_groups]
        self.step_count = 0
        self._apply()

    @classmethod
    def from_config(cls, optimizer: torch.optim.Optimizer, config: OptimizerConfig, total_steps: int) -> LRSchedule:
        warmup = int(config.warmup_steps_proportion * total_steps)
        return cls(optimizer, config.lr_scheduler, total_steps, warmup, config.min_lr_ratio)

    def factor(self, step: int) -> float:
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        if self.kind == "constant":
            return 1.0
        progress = min(1.0, (step - self.warmup_steps) / max(1, self.total_steps - self.warmup_steps))
        shape = 1.0 - progress if self.kind == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
        return self.min_lr_ratio + (1.0 - self.min_lr_ratio) * shape

    def _apply(self) -> None:
        f = self.factor(self.step_count)
        for group, base in zip(self.optimizer.param_groups, self.base_lrs, strict=True):
            group["lr"] = base * f

    def get_lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    def step(self) -> None:
        self.step_count += 1
        self._apply()

    def state_dict(self) -> dict:
        return {"step_count": self.step_count, "base_lrs": list(self.base_lrs)}

    def load_state_dict(self, state: dict) -> None:
        self.step_count = int(state["step_count"])
        self.base_lrs = [float(x) for x in state["base_lrs"]]
        self._apply()


@torch.no_grad()
def grads_by_layout(params: Iterable[torch.nn.Parameter]) -> dict[object, list[torch.nn.Parameter]]:
    """Parameters with gradients grouped by their gradients' (mesh, placements): a DTensor norm
    (and a foreach op) works within one layout, and FSDP x TP mixes 2-D and 1-D meshes in one model."""
    groups: dict[object, list[torch.nn.Parameter]] = {}
    for p in params:
        if p.grad is not None:
            key = (p.grad.device_mesh, p.grad.placements) if isinstance(p.grad, DTensor) else None
            groups.setdefault(key, []).append(p)
    return groups


def total_grad_norm(groups: dict[object, list[torch.nn.Parameter]]) -> torch.Tensor:
    """L2 norm of the gradients of `grads_by_layout` groups (not empty): each group's norm is a
    DTensor whose `full_tensor()` all-reduces the squares over the shards (counting a replicated
    value once), so every rank of the groups' meshes gets the same norm."""
    norms = []
    for group in groups.values():
        norm = torch.nn.utils.get_total_norm([p.grad for p in group], norm_type=2.0, foreach=True)
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    return torch.linalg.vector_norm(torch.stack(norms)) if len(norms) > 1 else norms[0]


def clip_grads(params: Iterable[torch.nn.Parameter], max_norm: float, total: torch.Tensor) -> None:
    """Scale the gradients down to `max_norm` when `total` exceeds it (and `max_norm > 0`)."""
    if max_norm > 0:
        for group in grads_by_layout(params).values():
            torch.nn.utils.clip_grads_with_norm_(group, max_norm, total, foreach=True)


def clip_grad_norm(params: Iterable[torch.nn.Parameter], max_norm: float) -> torch.Tensor:
    """Global L2 norm of all gradients (over every shard on every rank); scales them down to
    `max_norm` when it is exceeded and `max_norm > 0`. Returns the norm before clipping.

    With FSDP / tensor parallelism the grads are DTensors, possibly on different meshes and with
    different placements in one model (see `grads_by_layout`, `total_grad_norm`)."""
    params = [p for p in params if p.grad is not None]
    if not params:
        return torch.zeros(())
    total = total_grad_norm(grads_by_layout(params))
    clip_grads(params, max_norm, total)
    return total

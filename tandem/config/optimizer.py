"""The optimizer section (`actor.optimizer`): AdamW and its learning-rate schedule."""

from __future__ import annotations

from dataclasses import dataclass

from tandem.config.fields import config_field as _f


@dataclass
class OptimizerConfig:
    type: str = _f("adamw", "Optimizer.", choices=("adamw",))
    lr: float = _f(1e-6, "Peak learning rate.", min=0.0)
    weight_decay: float = _f(0.01, "Decoupled weight decay.", min=0.0)
    beta1: float = _f(0.9, "Adam beta1.", min=0.0, lt=1.0)
    beta2: float = _f(0.999, "Adam beta2.", min=0.0, lt=1.0)
    eps: float = _f(1e-8, "Adam epsilon.", min=0.0)
    gradient_clipping: float = _f(1.0, "Max global grad norm (0 disables clipping).", min=0.0)
    lr_scheduler: str = _f(
        "constant", "Learning-rate schedule after warmup.", choices=("constant", "linear", "cosine")
    )
    warmup_steps_proportion: float = _f(0.0, "Fraction of total steps spent in linear warmup.", min=0.0, max=1.0)
    min_lr_ratio: float = _f(0.0, "Floor of the decayed learning rate, as a fraction of lr.", min=0.0, max=1.0)

"""`Qwen3MoeArgs`: a Qwen3 decoder whose feed-forwards are (mostly) mixtures of experts."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tandem.errors import ModelConfigError
from tandem.models.qwen.args import QwenArgs, qwen_fields

MODEL_TYPES = ("qwen3_moe",)


@dataclass
class Qwen3MoeArgs(QwenArgs):
    """`QwenArgs` plus the MoE fields of transformers' `Qwen3MoeConfig`. Block i is a MoE block
    unless i is in `mlp_only_layers` or `(i + 1) % decoder_sparse_step != 0`; dense blocks use
    `intermediate_size`, experts `moe_intermediate_size`."""

    num_experts: int = 8
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 64
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = field(default_factory=list)
    router_aux_loss_coef: float = 0.001

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.num_experts < 1 or not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ModelConfigError(f"num_experts_per_tok ({self.num_experts_per_tok}) must be between 1 and "
                                   f"num_experts ({self.num_experts})")
        if self.decoder_sparse_step < 1:
            raise ModelConfigError(f"decoder_sparse_step must be >= 1, got {self.decoder_sparse_step}")
        bad = [i for i in self.mlp_only_layers if not 0 <= i < self.n_layers]
        if bad:
            raise ModelConfigError(f"mlp_only_layers {bad} are not layers of a {self.n_layers}-layer model")

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> Qwen3MoeArgs:
        model_type = cfg.get("model_type")
        if model_type not in MODEL_TYPES:
            raise ModelConfigError(f"model_type {model_type!r} is not a Qwen MoE type {MODEL_TYPES}")
        # transformers >= 5 writes `num_local_experts`; Qwen's own configs say `num_experts`.
        num_experts = cfg.get("num_experts", cfg.get("num_local_experts"))
        for key, value in (("num_experts", num_experts), ("num_experts_per_tok", cfg.get("num_experts_per_tok")),
                           ("moe_intermediate_size", cfg.get("moe_intermediate_size"))):
            if value is None:
                raise ModelConfigError(f"config.json for qwen3_moe lacks required key {key!r}")
        return cls(
            **qwen_fields(cfg),
            num_experts=int(num_experts),
            num_experts_per_tok=int(cfg["num_experts_per_tok"]),
            moe_intermediate_size=int(cfg["moe_intermediate_size"]),
            norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
            decoder_sparse_step=int(cfg.get("decoder_sparse_step", 1)),
            mlp_only_layers=[int(i) for i in cfg.get("mlp_only_layers") or []],
            router_aux_loss_coef=float(cfg.get("router_aux_loss_coef", 0.001)),
        )

    def is_moe_layer(self, layer: int) -> bool:
        return layer not in self.mlp_only_layers and (layer + 1) % self.decoder_sparse_step == 0

    @property
    def moe_layers(self) -> list[int]:
        """Indices of the MoE blocks, ascending (the layer axis of recorded routes)."""
        return [i for i in range(self.n_layers) if self.is_moe_layer(i)]

    def to_hf_config(self) -> dict[str, Any]:
        cfg = super().to_hf_config()
        cfg.update(num_experts=self.num_experts, num_experts_per_tok=self.num_experts_per_tok,
                   moe_intermediate_size=self.moe_intermediate_size, norm_topk_prob=self.norm_topk_prob,
                   decoder_sparse_step=self.decoder_sparse_step, mlp_only_layers=list(self.mlp_only_layers),
                   router_aux_loss_coef=self.router_aux_loss_coef)
        return cfg

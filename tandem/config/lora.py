"""`LoRAConfig`, the adapters a run trains (`actor.lora`; the adapters themselves:
`tandem.models.common.lora`, docs/lora.md).

It lives here, outside the models room, because every command reads it with the run config before
deciding anything: importing it must not import torch (the models room does), so that `tandem train`
says where it writes, or refuses a config, in a fraction of torch's import time."""

from __future__ import annotations

from dataclasses import dataclass, field

from tandem.config.fields import config_field as _f

# HF module names PEFT users target on Qwen-family models (attention, then the MLP).
DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass
class LoRAConfig:
    """`actor.lora`: the adapters a run trains (rank 0: none, the whole model trains)."""

    rank: int = _f(0, "LoRA rank r (0: no adapters; the whole model trains).", min=0)
    alpha: float = _f(16.0, "LoRA alpha: the adapter's output is scaled by alpha / rank.", gt=0.0)
    dropout: float = _f(0.0, "Dropout on the adapter's input (training forwards only).", min=0.0, lt=1.0)
    target_modules: list[str] = field(default_factory=lambda: list(DEFAULT_TARGETS), metadata={
        "help": "HF names of the linear layers that get adapters (PEFT's target_modules): q_proj k_proj v_proj "
                "o_proj (attention), gate_proj up_proj down_proj (dense MLPs)."})
    path: str = _f("", "A PEFT adapter directory (adapter_config.json + adapter_model.safetensors) to start from "
                       "(empty: a fresh adapter, B = 0). Its r, lora_alpha and target_modules must equal these keys.")

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    def peft_config(self, base_model: str = "") -> dict:
        """`adapter_config.json` in PEFT's format (what `peft.PeftConfig.from_pretrained` reads)."""
        return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
                "r": self.rank, "lora_alpha": self.alpha, "lora_dropout": self.dropout,
                "target_modules": sorted(self.target_modules), "bias": "none", "fan_in_fan_out": False,
                "use_rslora": False, "use_dora": False, "inference_mode": True, "modules_to_save": None}

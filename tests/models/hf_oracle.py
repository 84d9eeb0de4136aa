"""Reference models from transformers, used as the parity oracle (built from configs, offline)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import transformers


@dataclass(frozen=True)
class Case:
    id: str
    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    tie: bool
    head_dim: int | None = None  # None: hidden / heads
    rope_theta: float = 10000.0
    extra: dict[str, Any] = field(default_factory=dict)

    def hf_config(self) -> dict[str, Any]:
        cfg = {
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": 2 * self.hidden_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim or self.hidden_size // self.num_heads,
            "tie_word_embeddings": self.tie,
            "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta},
            "max_position_embeddings": 256,
            "rms_norm_eps": 1e-6,
            **self.extra,
        }
        return cfg


CASES = [
    Case("qwen3-tied-gqa2", "qwen3", 128, 32, 2, 4, 2, tie=True),
    Case("qwen3-untied-mqa-hd16-theta1e6", "qwen3", 300, 32, 1, 4, 1, tie=False, head_dim=16, rope_theta=1e6),
    Case("qwen3-bias-mha-3layers", "qwen3", 1000, 48, 3, 4, 4, tie=False, extra={"attention_bias": True}),
    Case("qwen3-tied-mqa-hd8", "qwen3", 200, 64, 2, 4, 1, tie=True, head_dim=8, rope_theta=5e5),
    Case("qwen2-untied-gqa2", "qwen2", 500, 32, 2, 4, 2, tie=False),
    Case("qwen2-tied-mqa-theta1e6", "qwen2", 100, 48, 1, 6, 1, tie=True, rope_theta=1e6),
    Case("qwen2-mha-3layers", "qwen2", 256, 32, 3, 2, 2, tie=False),
    Case("qwen2-tied-gqa-hd12", "qwen2", 700, 32, 2, 4, 2, tie=True, head_dim=12, rope_theta=2e4),
    # Qwen3-MoE: renormalised top-k or not, dense layers among the MoE ones, tied and untied.
    Case("qwen3moe-tied-norm-8x2", "qwen3_moe", 200, 32, 2, 4, 2, tie=True,
         extra={"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 16, "norm_topk_prob": True}),
    Case("qwen3moe-untied-raw-6x3-mlp-only", "qwen3_moe", 300, 48, 3, 4, 2, tie=False, head_dim=16,
         extra={"num_experts": 6, "num_experts_per_tok": 3, "moe_intermediate_size": 24, "norm_topk_prob": False,
                "mlp_only_layers": [1]}),
    Case("qwen3moe-untied-norm-step2-4x1", "qwen3_moe", 128, 32, 4, 4, 4, tie=False,
         extra={"num_experts": 4, "num_experts_per_tok": 1, "moe_intermediate_size": 8, "norm_topk_prob": True,
                "decoder_sparse_step": 2, "attention_bias": True}),
]


@torch.no_grad()
def make_hf_model(case: Case, seed: int = 0) -> transformers.PreTrainedModel:
    """A randomly initialised HF model whose weights are large enough to make every part matter
    (HF's 0.02 init leaves logits near zero; norms and biases start at trivial values)."""
    torch.manual_seed(seed)
    config = transformers.AutoConfig.for_model(case.model_type, **case.hf_config())
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    for name, param in model.named_parameters():
        if "norm" in name:
            param.copy_(1.0 + 0.2 * torch.randn_like(param))
        elif name.endswith("bias"):
            param.copy_(0.5 * torch.randn_like(param))
        else:
            param.copy_(torch.randn_like(param) / param.shape[-1] ** 0.5)
    return model


def random_sequences(vocab_size: int, lengths: list[int], seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_size, (n,), generator=gen) for n in lengths]


def pack(seqs: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Concatenate sequences -> (input_ids [T], cu_seqlens [B+1] int32)."""
    lengths = torch.tensor([0] + [len(s) for s in seqs])
    return torch.cat(seqs), lengths.cumsum(0).to(torch.int32)


@torch.no_grad()
def hf_padded_logits(model: transformers.PreTrainedModel, seqs: list[torch.Tensor]) -> list[torch.Tensor]:
    """Run the batch right-padded with an attention mask; return each sequence's valid logits."""
    longest = max(len(s) for s in seqs)
    input_ids = torch.zeros(len(seqs), longest, dtype=torch.long)
    mask = torch.zeros(len(seqs), longest, dtype=torch.long)
    for i, s in enumerate(seqs):
        input_ids[i, : len(s)] = s
        mask[i, : len(s)] = 1
    logits = model(input_ids=input_ids, attention_mask=mask).logits
    return [logits[i, : len(s)] for i, s in enumerate(seqs)]

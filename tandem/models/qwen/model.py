"""Qwen2 / Qwen3 dense decoder over packed variable-length sequences.

Input is a flat token stream `[T]` with `cu_seqlens [B+1]` marking sequence boundaries (no padding,
no batch dimension). Parameter names follow torchtitan; `state_dict_adapter` maps them to HF names.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any, Protocol

import torch
from torch import nn

from tandem.models.common import (
    GroupedExperts,
    MoE,
    RMSNorm,
    RotaryEmbedding,
    Routing,
    SwiGLU,
    apply_rotary_emb,
    packed_causal_attention,
    positions_from_cu_seqlens,
)
from tandem.models.common.attention import PackedAttention, choose_kernel
from tandem.models.common.lora import adapted
from tandem.models.qwen.args import QwenArgs
from tandem.models.registry import ModelSpec, get_model_spec


class AttentionBackend(Protocol):
    """Replaces packed causal attention, e.g. with paged attention over an inference KV cache.

    Called as `attn(layer_index, q [T, H, D], k [T, H_kv, D], v [T, H_kv, D]) -> [T, H, D]` with q/k
    already normed and rotated; the backend owns everything else (cache writes, which keys to attend).
    """

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor: ...


LayerAttention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class Attention(nn.Module):
    def __init__(self, args: QwenArgs):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = args.n_heads, args.n_kv_heads, args.head_dim
        self.wq = nn.Linear(args.dim, args.n_heads * args.head_dim, bias=args.qkv_bias)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=args.qkv_bias)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=args.qkv_bias)
        self.wo = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=args.o_bias)
        # Qwen3 normalises each head of q and k (before RoPE) to keep attention logits bounded.
        self.q_norm = RMSNorm(args.head_dim, args.norm_eps) if args.qk_norm else None
        self.k_norm = RMSNorm(args.head_dim, args.norm_eps) if args.qk_norm else None

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        cu_seqlens: torch.Tensor,
        attn: LayerAttention | None = None,
    ) -> torch.Tensor:
        num_tokens = x.shape[0]
        # Head counts from the projections' widths: under tensor parallelism each rank computes
        # only its own heads (n_heads / tp and n_kv_heads / tp).
        q = adapted(self, "wq", x).view(num_tokens, -1, self.head_dim)
        k = adapted(self, "wk", x).view(num_tokens, -1, self.head_dim)
        v = adapted(self, "wv", x).view(num_tokens, -1, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary_emb(q, *rope), apply_rotary_emb(k, *rope)
        if attn is None:
            out = packed_causal_attention(q, k, v, cu_seqlens, scale=self.head_dim**-0.5)
        else:
            out = attn(q, k, v)
        return adapted(self, "wo", out.reshape(num_tokens, -1))


class TransformerBlock(nn.Module):
    """Attention then a feed-forward: dense (`feed_forward`) or, where `args.is_moe_layer(layer)`,
    a mixture of experts (`moe`); the other attribute is None."""

    def __init__(self, args: QwenArgs, layer: int = 0):
        super().__init__()
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.attention = Attention(args)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.feed_forward: SwiGLU | None = None
        self.moe: MoE | None = None
        if args.is_moe_layer(layer):
            self.moe = MoE(layer, args.dim, args.moe_intermediate_size, args.num_experts,
                           args.num_experts_per_tok, args.norm_topk_prob)
        else:
            self.feed_forward = SwiGLU(args.dim, args.intermediate_size)

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        cu_seqlens: torch.Tensor,
        attn: LayerAttention | None = None,
        routing: Routing | None = None,
    ) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), rope, cu_seqlens, attn)
        if self.moe is not None:
            return h + self.moe(self.ffn_norm(h), routing)
        return h + self.feed_forward(self.ffn_norm(h))


class QwenModel(nn.Module):
    """Causal LM. `hf_config` is the source config.json (kept so saving writes a faithful one)."""

    def __init__(self, args: QwenArgs, hf_config: dict[str, Any] | None = None):
        super().__init__()
        self.args = args
        self.hf_config = dict(hf_config) if hf_config is not None else args.to_hf_config()
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.rope = RotaryEmbedding(args.head_dim, args.rope_theta)
        # A ModuleDict keyed by str(i), so pipeline stages can delete layers and keep the others' names.
        self.layers = nn.ModuleDict({str(i): TransformerBlock(args, i) for i in range(args.n_layers)})
        self.norm = RMSNorm(args.dim, args.norm_eps)
        # A value model's head gives one number per token (`tandem.models.value_head`).
        if args.value_head:
            self.output = nn.Linear(args.dim, 1)
        else:  # a sequence classifier's scores, or the vocabulary's logits
            self.output = nn.Linear(args.dim, args.num_labels or args.vocab_size, bias=False)
        self.tie_weights()
        # Set by a tensor-parallel plan: the token stream is padded to a multiple of this (the
        # sequence-parallel shards must be equal), and what the plan did (`TensorParallelInfo`).
        self.token_multiple = 1
        self.tensor_parallel = None
        # The packed-attention kernel (`tandem.models.common.attention.KERNELS`); the training
        # engine sets a concrete one from its device and compute dtype.
        self.attention_kernel = "auto"

    @property
    def model_type(self) -> str:
        return self.args.model_type

    @property
    def spec(self) -> ModelSpec:
        return get_model_spec(self.model_type)

    def tie_weights(self) -> None:
        """Share the embedding with the output head. Call again after `to_empty`/`_apply`, which
        materialise each module's parameters separately and so break the sharing."""
        if getattr(self, "untied_copies", False):
            return  # a pipeline rank holding the first and last stage keeps one copy per stage
        if (self.args.tie_word_embeddings and not self.args.value_head and not self.args.num_labels
                and self.output is not None
                and self.tok_embeddings is not None):
            self.output.weight = self.tok_embeddings.weight

    def hidden_states(
        self,
        input_ids: torch.Tensor,
        cu_seqlens: torch.Tensor,
        positions: torch.Tensor | None = None,
        attn: AttentionBackend | None = None,
        routing: Routing | None = None,
    ) -> torch.Tensor:
        """`[T]` token ids -> `[T, dim]` final-normed hidden states.

        `attn` (inference) replaces packed causal attention in every layer; it is called with the
        layer's index, so pass `positions` too when the tokens do not start at position 0.
        `routing` (MoE layers): records or replays the experts each token is routed to; its
        tensors have one row per token of `input_ids` (see `tandem.models.common.Routing`).
        """
        num_tokens = input_ids.shape[0]
        pad = -num_tokens % self.token_multiple
        if pad:  # trailing padding tokens form their own "sequence"; dropped below
            input_ids = torch.nn.functional.pad(input_ids, (0, pad))
            if positions is not None:
                positions = torch.nn.functional.pad(positions, (0, pad))
        if positions is None:
            positions = positions_from_cu_seqlens(cu_seqlens, input_ids.shape[0])
        h = self.tok_embeddings(input_ids)
        rope = self.rope(positions, h.dtype)
        packed = self.packed_attention(cu_seqlens, input_ids.shape[0], h.device, h.dtype) if attn is None else None
        for key, layer in self.layers.items():
            h = layer(h, rope, cu_seqlens, packed if attn is None else partial(attn, int(key)), routing)
        h = self.norm(h)
        return h[:num_tokens] if pad else h

    def packed_attention(self, cu_seqlens: torch.Tensor, num_tokens: int, device: torch.device,
                         dtype: torch.dtype) -> LayerAttention:
        """Every layer's attention over a packed stream of `num_tokens` (padding included), planned
        once, outside compiled blocks (`tandem.models.common.attention`): varlen or flex, or for
        `sdpa` the per-layer `packed_causal_attention` of the CPU."""
        scale = self.args.head_dim**-0.5
        kernel = choose_kernel(self.attention_kernel, device, dtype, self.args.head_dim)
        if kernel == "sdpa":
            return partial(packed_causal_attention, cu_seqlens=cu_seqlens, scale=scale, kernel="sdpa")
        return partial(PackedAttention.plan(cu_seqlens, num_tokens, kernel), scale=scale)

    def logits_from_hidden(self, h: torch.Tensor) -> torch.Tensor:
        """Apply the output head; callers may pass token chunks to bound logits memory. Under
        tensor parallelism: this rank's vocabulary slice of the logits (`tensor_parallel.vocab_range`).
        A value model: `[T, 1]` values."""
        return self.output(h)

    def forward(
        self,
        input_ids: torch.Tensor,
        cu_seqlens: torch.Tensor,
        positions: torch.Tensor | None = None,
        attn: AttentionBackend | None = None,
        routing: Routing | None = None,
    ) -> torch.Tensor:
        """`[T]` token ids of packed sequences -> `[T, vocab]` logits (model dtype)."""
        return self.logits_from_hidden(self.hidden_states(input_ids, cu_seqlens, positions, attn, routing))

    @torch.no_grad()
    def init_weights(self, seed: int | None = None) -> None:
        """Random init in place: normal(0, initializer_range) for linear and embedding weights,
        zeros for biases, ones for norms, zeros for a value head (every value 0 at the start).
        Deterministic for a given seed and device."""
        generator = None
        if seed is not None:
            device = next(self.parameters()).device
            generator = torch.Generator(device=device).manual_seed(seed)
        std = self.args.initializer_range
        for module in self.modules():
            if isinstance(module, RMSNorm):
                module.reset_parameters()
            elif isinstance(module, nn.Linear | nn.Embedding):
                if module is self.output and self.args.value_head:
                    module.weight.zero_()
                    module.bias.zero_()
                    continue
                if module is self.output and self.args.tie_word_embeddings and not self.args.num_labels:
                    continue  # shares the embedding, already initialised
                module.weight.normal_(0.0, std, generator=generator)
                if getattr(module, "bias", None) is not None:
                    module.bias.zero_()
            elif isinstance(module, GroupedExperts):
                for weight in (module.w1, module.w2, module.w3):
                    weight.normal_(0.0, std, generator=generator)

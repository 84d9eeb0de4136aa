"""Runs the trainer's native model over a step's sequences with a paged KV cache.

Owns the KV tensors (one `[n_layers, 2, n_kv_heads, num_blocks + 1, block_size, head_dim]`
tensor, each layer's keys stored transposed within a block: `layer_caches`), turns a scheduled batch into packed inputs + attention metadata (once per step, for every
layer) and returns float32 logits of each sequence's last position. The extra block (`pad_block`,
outside the block manager's range) pads block tables and key chunks and is never written. A MoE
model's runner also records each forwarded token's experts per KV slot
(`tandem.inference.routed_expert_cache`). See docs/inference.md, "KV cache and attention"."""

from __future__ import annotations

import itertools

import torch
from torch import nn

from tandem.inference import cpu_kernels
from tandem.inference.paged_attention import (
    AttentionMetadata,
    PagedAttentionBackend,
    build_decode_metadata,
    build_gathered_keys,
    build_prefill_pass,
)
from tandem.inference.routed_expert_cache import RoutedExpertCache
from tandem.inference.sequence import Sequence
from tandem.models.common.attention import choose_kernel


class ModelRunner:
    def __init__(self, model: nn.Module, num_blocks: int, block_size: int,
                 device: torch.device | str, dtype: torch.dtype, batch_invariant: bool = False):
        self.model = model
        # Batch invariance: decodes without shared-prefix passes, prefill attention per sequence
        # where PyTorch runs it (the CPU kernel's is per row already); linears are row-invariant as
        # packed, measured.
        self.batch_invariant = batch_invariant
        self.block_size = block_size
        self.device = torch.device(device)
        args = model.args
        # Pads block tables and key chunks and is never written: padded keys are masked but still read,
        # and a masked weight of 0 times a live block's inf is NaN.
        self.pad_block = num_blocks
        shape = (args.n_layers, 2, args.n_kv_heads, num_blocks + 1, block_size, args.head_dim)
        self.kv_cache = torch.zeros(shape, dtype=dtype, device=self.device)
        self.attn = PagedAttentionBackend(*self.layer_caches(), scale=args.head_dim**-0.5,
                                          batch_invariant=batch_invariant)
        self.routed_expert_cache = RoutedExpertCache.for_model(model, num_blocks, block_size, self.device)  # None: dense
        # KV writes and decode attention in the CPU kernel where it serves (built on first use; else PyTorch's).
        self.attention_kernel = self.device.type == "cpu" and dtype in (torch.float32, torch.bfloat16)
        # Prefill and decode attention through flash attention's varlen kernel (CUDA, fp16/bf16).
        self.varlen = choose_kernel("auto", self.device, dtype, args.head_dim) == "varlen"

    @property
    def attention_kernel(self) -> bool:
        """Whether KV writes and decode attention run in the CPU kernel (else their PyTorch forms)."""
        return self.attn.kernel is not None

    @attention_kernel.setter
    def attention_kernel(self, on: bool) -> None:
        self.attn.kernel = cpu_kernels.paged_attention() if on else None

    def layer_caches(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Per layer, views of `kv_cache`: keys `[n_kv_heads, blocks, head_dim, block_size]`
        (transposed within each block, `tandem.inference.paged_attention`), values
        `[n_kv_heads, blocks, block_size, head_dim]`; empty lists while the cache is released."""
        if self.kv_cache.dim() != 6:
            return [], []
        n_layers, _, h, blocks, bs, d = self.kv_cache.shape
        return ([self.kv_cache[i, 0].view(h, blocks, d, bs) for i in range(n_layers)],
                [self.kv_cache[i, 1] for i in range(n_layers)])

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy-on-write: duplicate whole blocks (all layers, k and v) before they are written."""
        if copies:
            src = torch.tensor([s for s, _ in copies], device=self.device)
            dst = torch.tensor([d for _, d in copies], device=self.device)
            self.kv_cache[:, :, :, dst] = self.kv_cache[:, :, :, src]
            if self.routed_expert_cache is not None:
                self.routed_expert_cache.copy_blocks(src, dst)

    def zero_blocks(self, block_ids: list[int]) -> None:
        """Zero the KV of `block_ids` (all layers, k and v): blocks freed by a request whose KV may
        hold NaN or inf, which masked slots of their next owner would still feed into attention."""
        if block_ids:
            ids = torch.tensor(block_ids, device=self.device)
            self.kv_cache[:, :, :, ids] = 0
            if self.routed_expert_cache is not None:
                self.routed_expert_cache.clear_blocks(ids)

    def routed_experts(self, seq: Sequence, num_tokens: int) -> torch.Tensor:
        """`[num_tokens, n_layers, top_k]` int32 experts of `seq`'s first `num_tokens` positions
        (MoE models only; -1 in dense layers and where not computed; `RoutedExpertCache.read`)."""
        assert self.routed_expert_cache is not None, "a dense model records no routed experts"
        return self.routed_expert_cache.read(seq.block_table, num_tokens)

    def _slots(self, seq: Sequence, start: int, end: int) -> list[int]:
        bs = self.block_size
        return [seq.block_table[p // bs] * bs + p % bs for p in range(start, end)]

    def prepare(self, seqs: list[Sequence], is_prefill: bool,
                shared_blocks: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (input_ids [T], positions [T]); sets the attention metadata for this step.
        `shared_blocks` (decode): leading blocks of each sequence that others may share."""
        if not is_prefill:
            return self._prepare_decode(seqs, shared_blocks or [0] * len(seqs))
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        cu_q = [0]
        for seq in seqs:
            start = seq.num_computed_tokens
            input_ids += seq.token_ids[start:]
            positions += range(start, len(seq))
            slots += self._slots(seq, start, len(seq))
            cu_q.append(len(input_ids))
        max_blocks = max(len(seq.block_table) for seq in seqs)
        tables = [seq.block_table + [self.pad_block] * (max_blocks - len(seq.block_table)) for seq in seqs]
        dev = self.device
        self.attn.meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
            cu_seqlens_q=torch.tensor(cu_q, dtype=torch.int32, device=dev),
            context_lens=torch.tensor([len(s) for s in seqs], dtype=torch.int32, device=dev),
            block_tables=torch.tensor(tables, dtype=torch.long, device=dev),
            max_query_len=max(b - a for a, b in itertools.pairwise(cu_q)),
            max_context_len=max(len(s) for s in seqs),
            no_cached_prefix=all(s.num_computed_tokens == 0 for s in seqs),
        )
        if self.varlen:  # per-sequence arithmetic: batch-invariant without key splits (the backend's)
            self.attn.meta.gathered = build_gathered_keys([s.block_table for s in seqs], [len(s) for s in seqs],
                                                          self.block_size, dev)
        elif self.attention_kernel:  # per-row arithmetic: batch-invariant as it stands
            self.attn.meta.prefill = build_prefill_pass(
                [s.block_table for s in seqs], [len(s) for s in seqs],
                [b - a for a, b in itertools.pairwise(cu_q)], dev)
        elif self.batch_invariant and len(seqs) > 1:  # built once per step, read by every layer
            self.attn.meta.parts = self.attn.meta.split()
        return (torch.tensor(input_ids, dtype=torch.long, device=dev),
                torch.tensor(positions, dtype=torch.long, device=dev))

    def _prepare_decode(self, seqs: list[Sequence], shared_blocks: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        bs, dev = self.block_size, self.device
        lens = [len(s) for s in seqs]
        tables = [s.block_table for s in seqs]
        positions = [n - 1 for n in lens]
        slots = [t[p // bs] * bs + p % bs for t, p in zip(tables, positions, strict=True)]
        self.attn.meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
            cu_seqlens_q=torch.arange(len(seqs) + 1, dtype=torch.int32, device=dev),
            context_lens=torch.tensor(lens, dtype=torch.int32, device=dev),
            block_tables=None,
            max_query_len=1,
            max_context_len=max(lens),
            no_cached_prefix=False,
            decode=None if self.varlen else build_decode_metadata(tables, lens, shared_blocks, bs, dev,
                                                                  pad_block=self.pad_block,
                                                                  kernel=self.attention_kernel),
            gathered=build_gathered_keys(tables, lens, bs, dev) if self.varlen else None,
        )
        return (torch.tensor([s.token_ids[-1] for s in seqs], dtype=torch.long, device=dev),
                torch.tensor(positions, dtype=torch.long, device=dev))

    @torch.inference_mode()
    def run(self, seqs: list[Sequence], is_prefill: bool, copies: list[tuple[int, int]],
            shared_blocks: list[int] | None = None) -> torch.Tensor:
        """Forward the step's new tokens; -> `[len(seqs), vocab]` float32 next-token logits."""
        self.copy_blocks(copies)
        input_ids, positions = self.prepare(seqs, is_prefill, shared_blocks)
        meta = self.attn.meta
        assert meta is not None
        routing = self.routed_expert_cache.routing() if self.routed_expert_cache is not None else None
        hidden = self.model.hidden_states(input_ids, meta.cu_seqlens_q, positions, attn=self.attn, routing=routing)
        if routing is not None:
            self.routed_expert_cache.write(routing, meta.slot_mapping)
        if is_prefill:
            hidden = hidden[meta.cu_seqlens_q[1:].to(torch.long) - 1]
        logits = self.model.logits_from_hidden(hidden).float()
        self.attn.meta = None
        return logits

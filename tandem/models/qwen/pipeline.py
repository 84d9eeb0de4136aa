"""Pipeline stages of a Qwen model: `split_qwen` cuts a (meta) `QwenModel` down to one pipeline
rank's part and returns one `QwenStage` per stage of that rank.

The stages share the model's submodules and names (`layers.{i}.*` keep their keys), so the model
is still what the optimizer, checkpoints and export see. With tied embeddings the first and last
stage each hold a copy; the trainer sums their gradients (`tandem.parallel.pipeline.sum_tied_grads`)
and exports the weight once. Details: docs/training.md, "Pipeline parallelism"."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from tandem.models.common import positions_from_cu_seqlens
from tandem.parallel.context_split import ContextSplit
from tandem.parallel.pipeline import PipelineLayout, pad_row, unpad_row

# (output head, hidden [n_local, dim], input_ids [n], cu_seqlens, temperature, wanted [n] | None,
# tensor-parallel info | None, context split | None) -> (logprobs [n], entropy [n]): under context
# parallelism `hidden` is this CP rank's slice and the head gathers the whole stream's outputs.
HeadFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]


class QwenStage(nn.Module):
    """One pipeline stage. Called by `torch.distributed.pipelining` with one stacked row (see
    `tandem.parallel.pipeline.StackedMicroBatches`): `x` is `[1, T]` token ids on the first stage
    and `[1, T, dim]` hidden states elsewhere; it returns `[1, T, dim]` hidden states, or on the
    last stage `([1, T], [1, T])` float32 next-token log-probs and entropy from `head` (zero
    after the real tokens). `temperature` is set on the module before a schedule runs."""

    def __init__(self, model: nn.Module, stage: int, layout: PipelineLayout, head: HeadFn,
                 cp_group: dist.ProcessGroup | None = None):
        super().__init__()
        self.stage, self.is_first, self.is_last = stage, stage == 0, stage == layout.n_stages - 1
        # None where another stage holds them: the model's attribute names, so a parallelize plan
        # written for the whole model (e.g. tensor parallel) applies to a stage as it is.
        self.tok_embeddings = model.tok_embeddings if self.is_first else None
        self.rope = model.rope
        self.layers = nn.ModuleDict({str(i): model.layers[str(i)] for i in layout.stage_layers(stage)})
        self.norm = model.norm if self.is_last else None
        self.output = model.output if self.is_last else None
        self.args = model.args
        self._head = head
        self.temperature = 1.0
        self.cp_group = cp_group if cp_group is not None and dist.get_world_size(cp_group) > 1 else None
        object.__setattr__(self, "_owner", model)  # not a submodule: for what a TP plan sets on it

    def local_rows(self, n_tokens: int) -> int:
        """Rows of this rank's activation for a stream of `n_tokens` tokens: all of them, under
        context parallelism this rank's contiguous slice (`ContextSplit`), and under tensor
        parallelism its sequence shard of that padded to a multiple of tp."""
        multiple = getattr(self._owner, "token_multiple", 1)
        if self.cp_group is not None:
            n_tokens = ContextSplit.of(n_tokens, self.cp_group, multiple).local_tokens
        return -(-n_tokens // multiple)

    def forward(self, x: torch.Tensor, *, tokens: torch.Tensor, cu_seqlens: torch.Tensor, sizes: torch.Tensor,
                wanted: torch.Tensor | None = None):
        width = tokens.shape[1]
        cu, (ids, want) = unpad_row(sizes, cu_seqlens, tokens, wanted)
        n = ids.shape[0]
        multiple = getattr(self._owner, "token_multiple", 1)
        split = None if self.cp_group is None else ContextSplit.of(n, self.cp_group, multiple)
        mine = n if split is None else split.local_tokens  # this rank's tokens of the stream
        rows = self.local_rows(n)
        padded = rows * multiple  # as QwenModel.hidden_states pads
        if self.is_first:
            local_ids = ids if split is None else split.local(ids)
            h = self.tok_embeddings(F.pad(local_ids, (0, padded - mine)))
        else:
            h = x[0, :rows]
        if split is None:
            rope = self.rope(positions_from_cu_seqlens(cu, padded), h.dtype)
            attn = self._owner.packed_attention(cu, padded, h.device, h.dtype)
        else:  # this slice's true positions; attention over the whole stream (Ulysses)
            positions = split.local(positions_from_cu_seqlens(cu, n))
            rope = self.rope(F.pad(positions, (0, padded - mine)), h.dtype)
            kernel = self._owner.packed_attention(cu, split.padded, h.device, h.dtype)
            attn = partial(split.attention(kernel), 0)
        for layer in self.layers.values():
            h = layer(h, rope, cu, attn)
        if not self.is_last:
            return pad_row(h, self.local_rows(width))
        hidden = self.norm(h)[:mine]
        tp = getattr(self._owner, "tensor_parallel", None)
        logprobs, entropy = self._head(self.output, hidden, ids, cu, self.temperature, want, tp, split)
        return pad_row(logprobs, width), pad_row(entropy, width)


def split_qwen(model: nn.Module, layout: PipelineLayout, pp_rank: int, head: HeadFn,
               cp_group: dist.ProcessGroup | None = None) -> list[QwenStage]:
    """Cut `model` (in place, before parallelising and materialising) to pipeline rank `pp_rank`'s
    part and return its stages in ascending order (see the module docstring). `cp_group`: the
    context-parallel group each stage splits its tokens over."""
    stages = layout.rank_stages(pp_rank)
    keep = {str(i) for s in stages for i in layout.stage_layers(s)}
    for key in [k for k in model.layers if k not in keep]:
        del model.layers[key]
    has_first, has_last = 0 in stages, layout.n_stages - 1 in stages
    if has_last and model.args.tie_word_embeddings:
        # Its own copy of the tied weight (filled from the embedding when loading); `tie_weights`
        # (called again by e.g. a tensor-parallel plan) must leave the copies apart.
        model.output.weight = nn.Parameter(torch.empty_like(model.output.weight))
        model.untied_copies = True
    if not has_first:
        model.tok_embeddings = None
    if not has_last:
        model.norm, model.output = None, None
    return [QwenStage(model, s, layout, head, cp_group) for s in stages]


def tied_copies(model: nn.Module) -> list[nn.Parameter]:
    """This rank's copies of a tied embedding/output weight (none for untied models)."""
    if not model.args.tie_word_embeddings:
        return []
    return [m.weight for m in (model.tok_embeddings, model.output) if m is not None]


def parameter_stage(name: str, layout: PipelineLayout) -> int:
    """The stage holding native parameter `name` (the tied output copy: the last stage)."""
    if name.startswith("tok_embeddings."):
        return 0
    if name.startswith("layers."):
        return layout.layer_stage(int(name.split(".")[1]))
    return layout.n_stages - 1

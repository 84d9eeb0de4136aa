"""Next-token log-probabilities and entropy, computed from hidden states in token chunks.

Position t of a packed sequence predicts token t+1, so `logprobs[t] = log p(x[t+1] | x[<=t])`.
The last token of each sequence predicts nothing inside the batch: it gets logprob 0 and
entropy 0. Logits only ever exist in float32 for one chunk of tokens at a time; with gradients
on, each chunk is recomputed in backward (activation checkpointing) so the autograd graph does
not keep every chunk's logits either.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup
from torch.utils.checkpoint import checkpoint

from tandem.data.batch import next_token_labels
from tandem.models.common import positions_from_cu_seqlens
from tandem.models.common.moe import Routing
from tandem.parallel.context_split import ContextSplit
from tandem.parallel.loss_parallel import vocab_parallel_logprobs_entropy
from tandem.parallel.tensor_parallel import TensorParallelInfo


def _chunk_logprobs_entropy(
    head: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor, labels: torch.Tensor, temperature: float,
    tp: TensorParallelInfo | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    if tp is not None:  # the head returns this rank's vocabulary slice: compute loss-parallel
        return vocab_parallel_logprobs_entropy(head(hidden), labels, tp.vocab_range()[0], tp.group, temperature)
    logits = head(hidden).float()
    if temperature != 1.0:
        logits = logits / temperature
    log_z = torch.logsumexp(logits, dim=-1)
    logprobs = logits.gather(-1, labels[:, None]).squeeze(-1) - log_z
    probs = torch.softmax(logits, dim=-1)
    entropy = log_z - (probs * logits).sum(-1)
    return logprobs, entropy


def chunked_logprobs_entropy(
    head: Callable[[torch.Tensor], torch.Tensor],
    hidden: torch.Tensor,
    labels: torch.Tensor,
    temperature: float = 1.0,
    chunk_size: int = 1024,
    tp: TensorParallelInfo | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 log p(labels) and entropy of softmax(head(hidden) / temperature), `[T]` each.
    With `tp`, `head` returns this TP rank's vocabulary slice of the logits (`tp.vocab_range()`)
    and both are computed loss-parallel (collective over `tp.group`; no full-vocabulary logits)."""
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    n = hidden.shape[0]
    recompute = torch.is_grad_enabled() and n > chunk_size
    outs = []
    for start in range(0, n, chunk_size):
        args = (head, hidden[start : start + chunk_size], labels[start : start + chunk_size], temperature, tp)
        if recompute:
            outs.append(checkpoint(_chunk_logprobs_entropy, *args, use_reentrant=False))
        else:
            outs.append(_chunk_logprobs_entropy(*args))
    return torch.cat([o[0] for o in outs]), torch.cat([o[1] for o in outs])


class LogprobModel(nn.Module):
    """Wraps a causal LM that has `hidden_states(ids, cu_seqlens, positions=None, attn=None)` and
    `logits_from_hidden(h)` and returns next-token log-probs and entropy. It is the FSDP root: the
    whole computation, output head included, happens inside its forward, where FSDP has the root
    parameters gathered.

    `cp_group` (context parallelism): every rank of the group calls forward with the same whole
    micro-batch; each runs the model on its slice of the tokens (Ulysses attention through the
    model's `attn` hook) and the output head on its slice, and all return the whole `[T]` results
    (see `tandem.parallel.context_split`). Set it before the first forward; None (default): one rank.

    When the model carries a `tensor_parallel` (`TensorParallelInfo`, set by its TP plan), its
    head is vocab-sharded and the log-probs are computed loss-parallel over the TP group."""

    def __init__(self, model: nn.Module, chunk_size: int = 1024, cp_group: ProcessGroup | None = None):
        super().__init__()
        self.model = model
        self.chunk_size = chunk_size
        self.cp_group = cp_group

    def forward(
        self, input_ids: torch.Tensor, cu_seqlens: torch.Tensor, temperature: float = 1.0,
        wanted: torch.Tensor | None = None, routing: Routing | None = None,
    ) -> tuple[torch.Tensor, ...]:
        """`wanted` (`[T]` bool, prediction alignment): compute the output head only at these
        positions (e.g. the loss tokens; 0 elsewhere). In RL most tokens are prompt tokens, and the
        head (a `[T, vocab]` matmul, softmax and its backward) is then most of a small model's step.

        `routing` (MoE models): its replay rows are aligned with `input_ids` (`[T, top_k]` per
        layer); what the forward records in it (ids used, live ids, router logits) comes back for
        all `T` tokens, under context parallelism too (each CP rank routes its slice; the records
        are gathered, the logits differentiably, like the log-probs)."""
        labels, valid = next_token_labels(input_ids, cu_seqlens)
        sparse = wanted is not None
        if wanted is not None:
            valid = valid & wanted
        tp = getattr(self.model, "tensor_parallel", None)
        if self.cp_group is None or dist.get_world_size(self.cp_group) == 1:
            hidden = self.model.hidden_states(input_ids, cu_seqlens, routing=routing)
            _trim_records(routing, input_ids.shape[0])
            return self.head(hidden, labels, valid, temperature, sparse, tp)
        split = ContextSplit.of(input_ids.shape[0], self.cp_group, getattr(self.model, "token_multiple", 1))
        positions = positions_from_cu_seqlens(cu_seqlens, input_ids.shape[0])
        local_routing = None if routing is None else _local_routing(routing, split)
        # The whole stream's attention, planned once; an `auto` kernel (a model the engine did not
        # set up) is chosen by the embedding's dtype.
        kernel = self.model.packed_attention(cu_seqlens, split.padded, input_ids.device,
                                             self.model.tok_embeddings.weight.dtype)
        hidden = self.model.hidden_states(split.local(input_ids), cu_seqlens, positions=split.local(positions),
                                          attn=split.attention(kernel), routing=local_routing)
        if routing is not None:
            for mine, whole in ((local_routing.recorded, routing.recorded), (local_routing.live, routing.live),
                                (local_routing.logits, routing.logits)):
                whole.update({layer: split.gather(x[:split.local_tokens]) for layer, x in mine.items()})
            _trim_records(routing, input_ids.shape[0])
        outputs = self.head(hidden, split.local(labels), split.local(valid, False), temperature, sparse, tp)
        return tuple(split.gather(x) for x in outputs)

    def head(self, hidden: torch.Tensor, labels: torch.Tensor, valid: torch.Tensor, temperature: float,
             sparse: bool, tp: TensorParallelInfo | None) -> tuple[torch.Tensor, ...]:
        """The per-token outputs at the `valid` rows of final hidden states `[T, dim]` (0
        elsewhere): (log-probs, entropy) of the next token."""
        return head_outputs(self.model.logits_from_hidden, hidden, labels, valid, temperature, sparse,
                            self.chunk_size, tp)


class ValueModel(LogprobModel):
    """The same wrapper around a value model (`tandem.models.value_head`): its forward returns
    `(values,)`, `values[t]` (float32) the value of the state after token t, the state token t+1
    is generated from (prediction alignment, like the log-probs), 0 at each sequence's last token
    and outside `wanted`. `temperature` is not used."""

    def head(self, hidden: torch.Tensor, labels: torch.Tensor, valid: torch.Tensor, temperature: float,
             sparse: bool, tp: TensorParallelInfo | None) -> tuple[torch.Tensor, ...]:
        del labels, temperature, sparse  # the head is [dim] -> 1: every row costs next to nothing
        if tp is not None:
            raise NotImplementedError("a value head under tensor parallelism")
        values = self.model.logits_from_hidden(hidden).squeeze(-1).float()
        return (torch.where(valid, values, values.new_zeros(())),)


def _trim_records(routing: Routing | None, num_tokens: int) -> None:
    """Recorded and live routes of the forward's `num_tokens` tokens only (a tensor-parallel MoE
    block records one row per token padded to a multiple of tp)."""
    if routing is not None:
        for records in (routing.recorded, routing.live):
            for layer, rows in records.items():
                records[layer] = rows[:num_tokens]


def _local_routing(routing: Routing, split: ContextSplit) -> Routing:
    """This CP rank's view of `routing`: replay rows sliced like the token ids (padding rows -1:
    live), the same record flags, empty records."""
    replay = None if routing.replay is None else {
        layer: split.local(rows, -1) for layer, rows in routing.replay.items()}
    return Routing(replay=replay, record=routing.record, keep_logits=routing.keep_logits,
                   record_live=routing.record_live)


def next_token_outputs(
    head: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor, input_ids: torch.Tensor,
    cu_seqlens: torch.Tensor, temperature: float = 1.0, wanted: torch.Tensor | None = None, chunk_size: int = 1024,
    tp: TensorParallelInfo | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`[T]` next-token log-probs and entropy from final hidden states `[T, dim]` (0 at each
    sequence's last token, and outside `wanted` when given; see `LogprobModel.forward`). A
    pipeline's last stage calls it too, so both compute exactly the same numbers."""
    labels, valid = next_token_labels(input_ids, cu_seqlens)
    if wanted is not None:
        valid = valid & wanted
    return head_outputs(head, hidden, labels, valid, temperature, wanted is not None, chunk_size, tp)


def head_outputs(
    head: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor, labels: torch.Tensor, valid: torch.Tensor,
    temperature: float, sparse: bool, chunk_size: int, tp: TensorParallelInfo | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs and entropy at the `valid` rows of `hidden` (0 elsewhere); `sparse`: run the
    head on those rows only (at least one, so its parameters always get a gradient)."""
    if sparse:
        picked = valid.nonzero().squeeze(-1)
        empty = picked.numel() == 0
        if empty:  # still run the head on one row, so its parameters get a (zero) gradient
            picked = torch.zeros(1, dtype=picked.dtype, device=picked.device)
        lp, ent = chunked_logprobs_entropy(head, hidden[picked], labels[picked], temperature, chunk_size, tp)
        if empty:
            lp, ent = lp * 0, ent * 0
        zeros = lp.new_zeros(hidden.shape[0])
        return zeros.index_add(0, picked, lp), zeros.index_add(0, picked, ent)  # differentiable in lp, ent
    logprobs, entropy = chunked_logprobs_entropy(head, hidden, labels, temperature, chunk_size, tp)
    zero = torch.zeros((), dtype=logprobs.dtype, device=logprobs.device)
    return torch.where(valid, logprobs, zero), torch.where(valid, entropy, zero)

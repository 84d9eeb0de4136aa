"""Batch types shared by the trainer and the algorithms (`tandem.train`, `tandem.algo`).

A `SequenceBatch` is a list of variable-length sequences, each a dict:
- `input_ids`: `[L]` integer token ids (required, L >= 1);
- per-token values: tensors whose first dim is L (e.g. `loss_mask`, `logprobs`, `advantages`);
- per-sequence scalars: 0-dim tensors or Python numbers (e.g. `reward`).
Every sequence has the same keys. Per-token values are in *input alignment*: position t describes
token t (e.g. `loss_mask[t] = 1` when token t was generated and should be learned).

A `MicroBatch` is a packed group of those sequences: tokens concatenated (`[T]`) with `cu_seqlens`,
per-token values concatenated, scalars stacked to `[B]`, and `indices` giving each sequence's
position in the original batch. A micro-batch with no sequences is padding: it exists only so that
every data-parallel rank runs the same number of forward/backward passes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

INPUT_IDS = "input_ids"
LOSS_MASK = "loss_mask"


def _as_tensor(value: Any) -> torch.Tensor:
    return value if isinstance(value, torch.Tensor) else torch.tensor(value)


@dataclass
class SequenceBatch:
    seqs: list[dict[str, Any]]

    def __post_init__(self) -> None:
        keys = set(self.seqs[0]) if self.seqs else {INPUT_IDS}
        for i, seq in enumerate(self.seqs):
            if set(seq) != keys:
                raise ValueError(f"sequence {i} has keys {sorted(seq)}, sequence 0 has {sorted(keys)}")
            ids = seq.get(INPUT_IDS)
            if not isinstance(ids, torch.Tensor) or ids.ndim != 1 or ids.numel() == 0:
                raise ValueError(f"sequence {i}: input_ids must be a non-empty 1-D tensor")
            for key, value in seq.items():
                value = _as_tensor(value)
                if value.ndim > 0 and value.shape[0] != ids.shape[0]:
                    raise ValueError(
                        f"sequence {i}: {key!r} has {value.shape[0]} entries for {ids.shape[0]} tokens "
                        "(per-token values need one per token; scalars must be 0-dim)"
                    )

    @classmethod
    def from_token_lists(cls, input_ids: Sequence[Sequence[int]], **values: Sequence[Any]) -> SequenceBatch:
        """Convenience: `from_token_lists([[1, 2, 3], [4, 5]], loss_mask=[[0, 1, 1], [1, 1]])`."""
        seqs = []
        for i, ids in enumerate(input_ids):
            seq: dict[str, Any] = {INPUT_IDS: torch.as_tensor(ids, dtype=torch.long)}
            for key, column in values.items():
                seq[key] = torch.as_tensor(column[i])
            seqs.append(seq)
        return cls(seqs)

    def __len__(self) -> int:
        return len(self.seqs)

    @property
    def lengths(self) -> list[int]:
        return [int(s[INPUT_IDS].shape[0]) for s in self.seqs]

    def select(self, indices: Sequence[int]) -> SequenceBatch:
        return SequenceBatch([self.seqs[i] for i in indices])

    def __wire_reduce__(self) -> tuple[Any, ...]:
        """How the trainer's RPC pickles a batch (`tandem.launch.rpc_wire`), column by column: each
        key whose values are tensors of one dtype and trailing shape travels as one concatenated
        tensor (per-token values) or one stacked tensor (0-dim scalars), rebuilt as views of it;
        anything else as it is. A batch of 32 sequences with 8 keys is then 8 tensors instead of
        256 (a round trip ~2.1 -> ~0.5 ms). Other picklers (multiprocessing's, which moves each
        storage to shared memory) pickle the sequences as they are."""
        lengths = self.lengths
        columns: dict[str, Any] = {}
        for key in self.seqs[0] if self.seqs else ():
            values = [seq[key] for seq in self.seqs]
            columns[key] = _pack_column(values, lengths)
        return _unpack_batch, (lengths, columns)


def _pack_column(values: list[Any], lengths: list[int]) -> tuple[str, Any]:
    first = values[0]
    if all(type(v) is torch.Tensor and v.dtype == first.dtype and v.device == first.device and not v.requires_grad
           for v in values):
        if all(v.ndim == 0 for v in values):
            return "stacked", torch.stack(values)
        if all(v.ndim > 0 and v.shape[0] == n and v.shape[1:] == first.shape[1:]
               for v, n in zip(values, lengths, strict=True)):
            return "concatenated", torch.cat(values)
    return "loose", values


def _unpack_batch(lengths: list[int], columns: dict[str, tuple[str, Any]]) -> SequenceBatch:
    seqs: list[dict[str, Any]] = [{} for _ in lengths]
    for key, (form, data) in columns.items():
        parts = data.unbind() if form == "stacked" else data.split(lengths) if form == "concatenated" else data
        for seq, part in zip(seqs, parts, strict=True):
            seq[key] = part
    batch = SequenceBatch.__new__(SequenceBatch)  # checked when it was built
    batch.seqs = seqs
    return batch


def shift_to_next_token(x: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Per-token values moved one position left within each sequence: out[t] = x[t+1], and the
    last token of each sequence (which predicts nothing in the batch) gets 0."""
    out = torch.roll(x, shifts=-1, dims=0)
    out[cu_seqlens[1:].long() - 1] = 0
    return out


@dataclass
class MicroBatch:
    indices: list[int]
    input_ids: torch.Tensor
    cu_seqlens: torch.Tensor
    tokens: dict[str, torch.Tensor] = field(default_factory=dict)
    scalars: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def is_padding(self) -> bool:
        return not self.indices

    @property
    def n_tokens(self) -> int:
        """Real tokens (0 for padding)."""
        return 0 if self.is_padding else int(self.input_ids.shape[0])

    @property
    def lengths(self) -> list[int]:
        return (self.cu_seqlens[1:] - self.cu_seqlens[:-1]).tolist()

    def to(self, device: torch.device | str) -> MicroBatch:
        return MicroBatch(
            self.indices,
            self.input_ids.to(device),
            self.cu_seqlens.to(device),
            {k: v.to(device) for k, v in self.tokens.items()},
            {k: v.to(device) for k, v in self.scalars.items()},
        )

    def next_token_view(self) -> MicroBatch:
        """The same micro-batch with per-token values in *prediction alignment*: position t holds
        the value of token t+1, the token that position t's log-prob is about (0 at each last token).
        Loss functions receive this view, so they never shift anything themselves."""
        shifted = {k: shift_to_next_token(v, self.cu_seqlens) for k, v in self.tokens.items()}
        return MicroBatch(self.indices, self.input_ids, self.cu_seqlens, shifted, self.scalars)


def pack_sequences(batch: SequenceBatch, indices: Sequence[int]) -> MicroBatch:
    """Concatenate the chosen sequences (in the given order); no indices -> a padding micro-batch
    of one dummy token, which runs through the model but never reaches a loss function."""
    if not indices:
        return MicroBatch([], torch.zeros(1, dtype=torch.long), torch.tensor([0, 1], dtype=torch.int32))
    seqs = [batch.seqs[i] for i in indices]
    lengths = torch.tensor([0] + [int(s[INPUT_IDS].shape[0]) for s in seqs])
    cu_seqlens = lengths.cumsum(0).to(torch.int32)
    tokens: dict[str, torch.Tensor] = {}
    scalars: dict[str, torch.Tensor] = {}
    for key in seqs[0]:
        if key == INPUT_IDS:
            continue
        values = [_as_tensor(s[key]) for s in seqs]
        if values[0].ndim == 0:
            scalars[key] = torch.stack(values)
        else:
            tokens[key] = torch.cat(values)
    input_ids = torch.cat([s[INPUT_IDS] for s in seqs]).long()
    return MicroBatch(list(indices), input_ids, cu_seqlens, tokens, scalars)


def next_token_labels(input_ids: torch.Tensor, cu_seqlens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(labels `[T]`, valid `[T]` bool): labels[t] = input_ids[t+1] where t is not a sequence end."""
    labels = torch.roll(input_ids, shifts=-1)
    valid = torch.ones_like(input_ids, dtype=torch.bool)
    valid[cu_seqlens[1:].long() - 1] = False
    return torch.where(valid, labels, torch.zeros_like(labels)), valid


def loss_mask_of(mb: MicroBatch) -> torch.Tensor:
    """The micro-batch's loss mask as float; every predicted token counts when it has none."""
    if LOSS_MASK in mb.tokens:
        return mb.tokens[LOSS_MASK].float()
    return next_token_labels(mb.input_ids, mb.cu_seqlens)[1].float()


def count_loss_tokens(mb: MicroBatch) -> torch.Tensor:
    """The default loss weight: the number of tokens that get a loss."""
    return loss_mask_of(mb).sum()

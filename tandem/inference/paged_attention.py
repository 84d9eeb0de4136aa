"""Attention over a paged KV cache, pure PyTorch (any device).

A layer's value cache is `[n_kv_heads, num_blocks, block_size, head_dim]` and its key cache
`[n_kv_heads, num_blocks, head_dim, block_size]`: keys are stored transposed within a block, so the
CPU kernel reads 16 keys of one head dim as one vector (`keys_of` gives the usual layout). A step's
tokens are packed as in training (`cu_seqlens_q`) and each sequence's keys are found through its
block table. On CPU the C++ kernel serves prefills and decodes alike (`kernel_attention` over
`KernelPass`es: `build_prefill_pass`, `build_decode_metadata(kernel=True)`). Otherwise
`prefill_attention` serves prefills with nothing cached (causal SDPA per bucket of similar lengths),
`paged_attention` prefills over a cached prefix (one masked SDPA over padded sequences);
`decode_attention` serves decodes (cascade attention in key chunks: a shared prompt prefix is read
once per group, combined exactly by log-sum-exp), with indices built once per step by
`build_decode_metadata`. On CUDA in float16/bfloat16, `varlen_paged_attention` serves prefills and
decodes alike: each sequence's keys gathered from the cache (`build_gathered_keys`, once per step)
into one packed stream for flash attention's varlen kernel. See docs/inference.md, "KV cache and
attention"."""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from types import ModuleType

import torch
import torch.nn.functional as F

from tandem.inference import cpu_kernels
from tandem.models.common import padded_causal_attention
from tandem.models.common.attention import varlen_attention


@dataclass
class ChunkPass:
    """One batch of attention work: tasks (a set of R query rows, the same keys) over key chunks.

    A task's keys are cut into chunks of C blocks; chunk u belongs to task `chunk_task[u]`, reads
    blocks `blocks[u*C:(u+1)*C]` (padding with the padding block) and masks padded keys with
    `key_bias`.
    """

    q_rows: torch.Tensor  # [U, R] the sequence whose query fills each row of each chunk's task
    blocks: torch.Tensor  # [U * C] block ids, chunk-major
    key_bias: torch.Tensor  # [U, C * block_size] 0 for a valid key, -inf for padding
    chunk_task: torch.Tensor  # [U] task of each chunk
    num_tasks: int
    single_chunk: bool  # one chunk per task, in task order: nothing to reduce across chunks
    seq_row: torch.Tensor | None  # [B] flat row (task * R + r) of each sequence; num_tasks * R = none; None: identity


@dataclass
class KernelPass:
    """One batch of attention work for the CPU kernel (`csrc/paged_attention.cpp`): task u is R
    query rows over the keys of blocks `blocks[u]`, `nkeys[u]` of them, read in place."""

    rows: torch.Tensor  # [U, R] int64 the query row (a sequence; a token in a prefill) of each task row
    blocks: torch.Tensor  # [U, max blocks] int64, each task's key blocks in order (0 past its keys)
    nkeys: torch.Tensor  # [U] int64
    row_keys: torch.Tensor | None = None  # [U, R] int64 each row's own key count (causal prefill); None: nkeys

    def args(self) -> list[torch.Tensor]:
        """The pass as the kernel's `attend` takes it."""
        out = [self.rows, self.blocks, self.nkeys]
        return out if self.row_keys is None else [*out, self.row_keys]


Pass = ChunkPass | KernelPass


@dataclass
class GatheredKeys:
    """A step's keys for the varlen kernel: sequence i's keys 0..c_i-1 (cached and new) read from
    the cache into one packed stream, key j from block `blocks[j]` at offset `offsets[j]`;
    `cu_seqlens_k` bounds each sequence's keys."""

    blocks: torch.Tensor  # [T_k] int64
    offsets: torch.Tensor  # [T_k] int64
    cu_seqlens_k: torch.Tensor  # [B+1] int32
    max_k: int


def build_gathered_keys(block_tables: list[list[int]], context_lens: list[int], block_size: int,
                        device: torch.device) -> GatheredKeys:
    """Per step, for all layers: where each sequence's keys live (on the host, then one copy)."""
    lens = torch.tensor(context_lens, dtype=torch.long)
    seq = torch.repeat_interleave(torch.arange(len(context_lens)), lens)
    pos = torch.arange(int(lens.sum())) - (torch.cumsum(lens, 0) - lens)[seq]
    width = max(len(t) for t in block_tables)
    tables = torch.tensor([t + [0] * (width - len(t)) for t in block_tables], dtype=torch.long)
    where = torch.stack([tables[seq, pos // block_size], pos % block_size]).to(device)
    cu = torch.tensor([0, *itertools.accumulate(context_lens)], dtype=torch.int32).to(device)
    return GatheredKeys(where[0], where[1], cu, max(context_lens))


def varlen_paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           meta: AttentionMetadata, scale: float, batch_invariant: bool = False) -> torch.Tensor:
    """q `[T, H, D]` (a prefill's new tokens or a decode's one per sequence, their k/v already
    written) -> `[T, H, D]`: each query attends causally to its sequence's keys, gathered as
    `meta.gathered` says, through flash attention's varlen kernel (CUDA, float16/bfloat16)."""
    g = meta.gathered
    assert g is not None, "build_gathered_keys first"
    keys = k_cache.permute(1, 3, 0, 2)[g.blocks, g.offsets]  # [blocks, block_size, H_kv, D] -> [T_k, H_kv, D]
    values = v_cache.permute(1, 2, 0, 3)[g.blocks, g.offsets]
    return varlen_attention(q, keys, values, meta.cu_seqlens_q, g.cu_seqlens_k, meta.max_query_len, g.max_k,
                            scale, batch_invariant=batch_invariant)


@dataclass
class DecodeMetadata:
    suffix: Pass  # every sequence: its keys past its shared prefix (at least its newest one)
    prefix: list[Pass]  # shared prefixes, one pass per padded group size


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] flat cache slot (block * block_size + offset) of each new token
    cu_seqlens_q: torch.Tensor  # [B+1] new tokens per sequence, cumulative
    context_lens: torch.Tensor  # [B] keys per sequence: cached + new
    block_tables: torch.Tensor | None  # [B, max_blocks], padded with the padding block (masked out); prefill only
    max_query_len: int
    max_context_len: int
    no_cached_prefix: bool  # every sequence attends only to its new tokens (plain prefill)
    decode: DecodeMetadata | None = None  # set for decode steps (one new token per sequence)
    prefill: KernelPass | None = None  # a prefill's attention in the CPU kernel, where the runner uses it
    gathered: GatheredKeys | None = None  # prefill or decode through the varlen kernel (CUDA), where the runner uses it
    # Batch invariance (prefill): each sequence's rows and its metadata alone (`split`); attention
    # then runs per sequence, with exactly the calls and shapes it would run by itself.
    parts: list[tuple[slice, AttentionMetadata]] | None = None

    def split(self) -> list[tuple[slice, AttentionMetadata]]:
        """Prefill: per sequence, its rows of the step's tokens and its metadata alone (its block
        table keeps the step's padding, whose keys past its context are sliced off)."""
        assert self.block_tables is not None, "per-sequence metadata is for prefills"
        cu, contexts = self.cu_seqlens_q.tolist(), self.context_lens.tolist()
        return [(slice(start, end), AttentionMetadata(
            slot_mapping=self.slot_mapping[start:end],
            cu_seqlens_q=self.cu_seqlens_q.new_tensor([0, end - start]),
            context_lens=self.context_lens[i:i + 1],
            block_tables=self.block_tables[i:i + 1],
            max_query_len=end - start,
            max_context_len=context,
            no_cached_prefix=end - start == context,
        )) for i, (start, end, context) in enumerate(zip(cu[:-1], cu[1:], contexts, strict=True))]


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, kernel: ModuleType | None = None) -> None:
    """k/v `[T, H_kv, D]` into their slots (block * block_size + offset) of the caches. `kernel`:
    the CPU extension (`cpu_kernels.paged_attention()`) writes them in one pass (medium preset's
    shapes, 2 threads: 256 decode tokens 64 -> 28-41 us a layer, 4096 prefill tokens 1.9-2.7 ->
    1.0-1.8 ms) instead of two indexed writes."""
    if kernel is not None:
        kernel.write_kv(k.contiguous(), v.contiguous(), k_cache, v_cache, slot_mapping)
        return
    h, bs, d = v_cache.shape[0], v_cache.shape[2], v_cache.shape[3]
    k_cache[:, slot_mapping // bs, :, slot_mapping % bs] = k  # indexed dims first: [T, H_kv, D]
    v_cache.view(h, -1, d).index_copy_(1, slot_mapping, v.transpose(0, 1))


def keys_of(k_cache: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """The keys of `blocks` (`[N]` block ids) in the usual layout, `[H_kv, N, block_size, D]`."""
    return k_cache.index_select(1, blocks).transpose(-1, -2)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """q `[T, H, D]` -> `[T, H, D]`: each query attends causally to its sequence's cached keys.

    Sequences are padded to the longest query and context and run as one masked SDPA batch; the
    query at index t of a sequence with c keys and l new tokens sits at position c - l + t and may
    see keys 0..c - l + t. Padded query rows are computed and dropped.
    """
    assert meta.block_tables is not None
    num_seqs = meta.block_tables.shape[0]
    device = q.device
    h_kv, d = v_cache.shape[0], v_cache.shape[-1]
    flat = meta.block_tables.reshape(-1)
    keys = keys_of(k_cache, flat).reshape(h_kv, num_seqs, -1, d)[:, :, : meta.max_context_len]
    values = v_cache.index_select(1, flat).view(h_kv, num_seqs, -1, d)[:, :, : meta.max_context_len]
    q_lens = meta.cu_seqlens_q[1:] - meta.cu_seqlens_q[:-1]
    t = torch.arange(meta.max_query_len, device=device)
    q_index = (meta.cu_seqlens_q[:-1, None] + t[None, :]).clamp(max=q.shape[0] - 1)  # [B, Q]
    q_valid = t[None, :] < q_lens[:, None]
    q_pos = (meta.context_lens - q_lens)[:, None] + t[None, :]
    k_pos = torch.arange(meta.max_context_len, device=device)
    mask = k_pos[None, None, :] <= q_pos[:, :, None]  # [B, Q, K]
    out = F.scaled_dot_product_attention(
        q[q_index].transpose(1, 2),  # [B, H, Q, D]
        keys.transpose(0, 1),  # [B, H_kv, K, D]
        values.transpose(0, 1),
        attn_mask=mask[:, None],
        scale=scale,
        enable_gqa=q.shape[1] != h_kv,
    )
    return out.transpose(1, 2)[q_valid]


# ------------------------------------------------------------------------------------------ decode
def _choose_chunk(task_blocks: list[int], max_padding: float = 0.15) -> int:
    """Blocks per chunk: the largest candidate whose padding stays within `max_padding` of the
    real key blocks (bigger chunks mean fewer, larger matmuls); one chunk per task when it fits."""
    total, longest = sum(task_blocks), max(task_blocks)
    best = 1
    for c in (2, 4, 8, 16, 32, longest):
        if c <= longest and sum(-(-n // c) * c for n in task_blocks) <= total * (1 + max_padding):
            best = max(best, c)
    return best


def _chunk_pass(tasks: list[tuple[list[int], list[int], int]], rows: int, num_seqs: int, block_size: int,
                device: torch.device, identity: bool = False, pad_block: int = 0) -> ChunkPass:
    """tasks: (query sequences, key blocks, key count) -> the pass's tensors. `identity`: task i is
    sequence i alone (the suffix pass), so results need no remapping. `pad_block` fills chunks."""
    c = _choose_chunk([len(b) for _, b, _ in tasks])
    q_rows: list[list[int]] = []
    blocks: list[int] = []
    valid: list[int] = []
    chunk_task: list[int] = []
    span = c * block_size
    for t, (members, task_blocks, num_keys) in enumerate(tasks):
        padded_members = members + [members[0]] * (rows - len(members))
        for start in range(0, len(task_blocks), c):
            chunk = task_blocks[start : start + c]
            blocks += chunk + [pad_block] * (c - len(chunk))
            valid.append(min(span, num_keys - start * block_size))
            q_rows.append(padded_members)
            chunk_task.append(t)
    valid_t = torch.tensor(valid, device=device)
    key_bias = torch.zeros(len(valid), span, device=device)
    key_bias.masked_fill_(torch.arange(span, device=device)[None, :] >= valid_t[:, None], float("-inf"))
    return ChunkPass(
        q_rows=torch.tensor(q_rows, device=device),
        blocks=torch.tensor(blocks, device=device),
        key_bias=key_bias,
        chunk_task=torch.tensor(chunk_task, device=device),
        num_tasks=len(tasks),
        single_chunk=len(chunk_task) == len(tasks),
        seq_row=None if identity else _seq_rows(tasks, rows, num_seqs, device),
    )


def _seq_rows(tasks: list[tuple[list[int], list[int], int]], rows: int, num_seqs: int,
              device: torch.device) -> torch.Tensor:
    """`[B]` the flat row (task * rows + r) of each sequence; `len(tasks) * rows` (the sentinel
    row) for a sequence in no task."""
    row_of = [len(tasks) * rows] * num_seqs
    for t, (members, _, _) in enumerate(tasks):
        for r, s in enumerate(members):
            row_of[s] = t * rows + r
    return torch.tensor(row_of, device=device)


def _kernel_pass(tasks: list[tuple[list[int], list[int], int]], rows: int, device: torch.device) -> KernelPass:
    """tasks -> the kernel's tensors (`_chunk_pass`'s arguments; padding rows repeat the first)."""
    width = max(len(b) for _, b, _ in tasks)
    return KernelPass(
        rows=torch.tensor([m + [m[0]] * (rows - len(m)) for m, _, _ in tasks], dtype=torch.long, device=device),
        blocks=torch.tensor([b + [0] * (width - len(b)) for _, b, _ in tasks], dtype=torch.long, device=device),
        nkeys=torch.tensor([n for _, _, n in tasks], dtype=torch.long, device=device),
    )


def build_decode_metadata(block_tables: list[list[int]], context_lens: list[int], shared_blocks: list[int],
                          block_size: int, device: torch.device, pad_block: int = 0,
                          kernel: bool = False) -> DecodeMetadata:
    """Per step, for all layers. `shared_blocks[i]`: how many leading (full) blocks of sequence i
    other sequences may share. Sequences whose leading `shared_blocks` block ids are identical form
    a group whose prefix is attended once; groups are batched by their size rounded up to a power
    of two (the rows of one prefix task). `pad_block`: the block chunks are padded with (its keys
    are masked, but read: it must hold finite values; the model runner keeps one that nothing
    writes). `kernel`: passes for the CPU kernel (`KernelPass`, no chunks) instead of PyTorch's."""
    groups: dict[tuple[int, ...], list[int]] = {}
    for i, (table, k) in enumerate(zip(block_tables, shared_blocks, strict=True)):
        k = min(k, len(table) - 1)  # the last block is the sequence's own (it writes there)
        if k > 0:
            groups.setdefault(tuple(table[:k]), []).append(i)
    prefix_len = [0] * len(block_tables)
    by_rows: dict[int, list[tuple[list[int], list[int], int]]] = {}
    for key, members in groups.items():
        if len(members) < 2:
            continue
        for s in members:
            prefix_len[s] = len(key)
        rows = 1 << (len(members) - 1).bit_length()
        by_rows.setdefault(rows, []).append((members, list(key), len(key) * block_size))
    suffix_tasks = [([i], table[prefix_len[i]:], n - prefix_len[i] * block_size)
                    for i, (table, n) in enumerate(zip(block_tables, context_lens, strict=True))]
    num_seqs = len(block_tables)
    if kernel:
        return DecodeMetadata(
            suffix=_kernel_pass(suffix_tasks, 1, device),
            prefix=[_kernel_pass(tasks, rows, device) for rows, tasks in sorted(by_rows.items())],
        )
    return DecodeMetadata(
        suffix=_chunk_pass(suffix_tasks, 1, num_seqs, block_size, device, identity=True, pad_block=pad_block),
        prefix=[_chunk_pass(tasks, rows, num_seqs, block_size, device, pad_block=pad_block)
                for rows, tasks in sorted(by_rows.items())],
    )


def build_prefill_pass(block_tables: list[list[int]], context_lens: list[int], query_lens: list[int],
                       device: torch.device, rows: int = 16) -> KernelPass:
    """A prefill step for the CPU kernel: each sequence's new tokens (packed in order, as the step's
    queries) in runs of `rows`, each run one task over the sequence's blocks up to its last token,
    each token (at position p) seeing keys 0..p (causal, cached prefix included)."""
    task_rows: list[list[int]] = []
    row_keys: list[list[int]] = []
    tables: list[list[int]] = []
    first = 0
    for table, context, new in zip(block_tables, context_lens, query_lens, strict=True):
        for start in range(0, new, rows):
            run = range(start, min(start + rows, new))
            keys = [context - new + t + 1 for t in run]
            pad = rows - len(run)
            task_rows.append([first + t for t in run] + [first + start] * pad)
            row_keys.append(keys + [keys[0]] * pad)
            tables.append(table)
        first += new
    width = max(len(t) for t in tables)
    return KernelPass(
        rows=torch.tensor(task_rows, dtype=torch.long, device=device),
        blocks=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.long, device=device),
        nkeys=torch.tensor([max(keys) for keys in row_keys], dtype=torch.long, device=device),
        row_keys=torch.tensor(row_keys, dtype=torch.long, device=device),
    )


def kernel_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, passes: list[KernelPass],
                     scale: float) -> torch.Tensor:
    """q `[N, H, D]` (query rows: a decode's sequences or a prefill's new tokens, their k/v already
    written) -> `[N, H, D]`, `passes` run and merged in the CPU kernel (scores in float32: a bf16
    query is widened first)."""
    kernel = cpu_kernels.paged_attention()
    assert kernel is not None, "a KernelPass is built only where the kernel loaded"
    num_rows, num_heads, d = q.shape
    h_kv = v_cache.shape[0]
    qv = (q.float() * scale).view(num_rows, h_kv, num_heads // h_kv, d)  # query head h uses kv head h // G
    return kernel.attend(qv, k_cache, v_cache, [p.args() for p in passes]).view(num_rows, num_heads, d).to(q.dtype)


def _attend_pass(qv: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 p: ChunkPass) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """qv `[B, H_kv, G, D]` (pre-scaled) -> per sequence (m `[H_kv, B, G]`, den `[H_kv, B, G]`,
    o `[H_kv, B, G, D]`): running max of the scores, sum of exp(score - m), sum of exp * value.
    """
    num_seqs, h_kv, g, d = qv.shape
    num_chunks, rows = p.q_rows.shape
    span = p.key_bias.shape[1]
    if p.seq_row is None and rows == 1 and p.single_chunk:
        q = qv.transpose(0, 1)  # [H_kv, B, G, D]: chunk i is sequence i
    else:
        q = qv[p.q_rows].permute(2, 0, 1, 3, 4).reshape(h_kv, num_chunks, rows * g, d)
    k = keys_of(k_cache, p.blocks).reshape(h_kv, num_chunks, span, d)
    v = v_cache.index_select(1, p.blocks).view(h_kv, num_chunks, span, d)
    s = torch.matmul(q, k.transpose(-1, -2)).add_(p.key_bias[None, :, None, :])  # [H_kv, U, R*G, span]
    m = s.amax(-1)
    if p.single_chunk:
        s.sub_(m[..., None])
    else:
        index = p.chunk_task[None, :, None].expand_as(m)
        m = m.new_full((h_kv, p.num_tasks, rows * g), -math.inf).scatter_reduce_(1, index, m, "amax")
        s.sub_(m.index_select(1, p.chunk_task)[..., None])
    s.exp_()
    den = s.sum(-1)
    o = torch.matmul(s, v)  # [H_kv, U, R*G, D]
    if not p.single_chunk:
        den = torch.zeros_like(m).index_add_(1, p.chunk_task, den)
        o = torch.zeros(h_kv, p.num_tasks, rows * g, d, device=o.device, dtype=o.dtype).index_add_(1, p.chunk_task, o)
    return _by_sequence(m, den, o, p.seq_row, num_seqs, g)


def _by_sequence(m: torch.Tensor, den: torch.Tensor, o: torch.Tensor, seq_row: torch.Tensor | None,
                 num_seqs: int, g: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A pass's per-row results (`[H_kv, tasks, rows * G(, D)]`) -> per sequence (`[H_kv, B, G(, D)]`)."""
    h_kv, d = o.shape[0], o.shape[-1]
    if seq_row is None:
        return m.view(h_kv, num_seqs, g), den.view(h_kv, num_seqs, g), o.view(h_kv, num_seqs, g, d)
    # Rows -> sequences; a sequence outside this pass reads the sentinel row (-inf, 0, 0).
    m = torch.cat([m.reshape(h_kv, -1, g), m.new_full((h_kv, 1, g), -math.inf)], 1).index_select(1, seq_row)
    den = torch.cat([den.reshape(h_kv, -1, g), den.new_zeros(h_kv, 1, g)], 1).index_select(1, seq_row)
    o = torch.cat([o.reshape(h_kv, -1, g, d), o.new_zeros(h_kv, 1, g, d)], 1).index_select(1, seq_row)
    return m, den, o


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: DecodeMetadata,
                     scale: float) -> torch.Tensor:
    """q `[B, H, D]` (one new token per sequence, its k/v already written) -> `[B, H, D]`."""
    num_seqs, num_heads, d = q.shape
    h_kv = v_cache.shape[0]
    if isinstance(meta.suffix, KernelPass):
        return kernel_attention(q, k_cache, v_cache, [meta.suffix, *meta.prefix], scale)
    qv = (q * scale).view(num_seqs, h_kv, num_heads // h_kv, d)  # query head h uses kv head h // G
    m, den, o = _attend_pass(qv, k_cache, v_cache, meta.suffix)  # finite: every sequence has its newest key
    for p in meta.prefix:
        m2, den2, o2 = _attend_pass(qv, k_cache, v_cache, p)
        m_new = torch.maximum(m, m2)
        w, w2 = (m - m_new).exp_(), (m2 - m_new).exp_()
        den = den * w + den2 * w2
        o = o * w[..., None] + o2 * w2[..., None]
        m = m_new
    out = o / den[..., None]  # [H_kv, B, G, D]
    return out.permute(1, 0, 2, 3).reshape(num_seqs, num_heads, d).to(q.dtype)


class PagedAttentionBackend:
    """The model's attention hook for one step: store the new k/v, then attend through the cache."""

    def __init__(self, k_caches: list[torch.Tensor], v_caches: list[torch.Tensor], scale: float,
                 batch_invariant: bool = False):
        self.k_caches, self.v_caches, self.scale = k_caches, v_caches, scale
        self.batch_invariant = batch_invariant
        self.meta: AttentionMetadata | None = None
        self.kernel: ModuleType | None = None  # the CPU extension, where the model runner uses it
        # (`ModelRunner.attention_kernel`): KV writes here, decode passes through the metadata

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        meta = self.meta
        assert meta is not None, "set the step's AttentionMetadata first"
        k_cache, v_cache = self.k_caches[layer], self.v_caches[layer]
        write_kv(k, v, k_cache, v_cache, meta.slot_mapping, self.kernel)
        if meta.gathered is not None:
            return varlen_paged_attention(q, k_cache, v_cache, meta, self.scale, self.batch_invariant)
        if meta.decode is not None:
            return decode_attention(q, k_cache, v_cache, meta.decode, self.scale)
        if meta.parts is not None:
            # Batch invariance: padding to the step's longest sequence changes the softmax's
            # reduction order (measured: logprobs moved by up to 1e-6), so each sequence runs alone.
            return torch.cat([self._prefill(q[rows], k[rows], v[rows], k_cache, v_cache, part)
                              for rows, part in meta.parts])
        return self._prefill(q, k, v, k_cache, v_cache, meta)

    def _prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        if meta.prefill is not None:
            return kernel_attention(q, k_cache, v_cache, [meta.prefill], self.scale)
        if meta.no_cached_prefix:
            return prefill_attention(q, k, v, meta.cu_seqlens_q, self.scale)
        return paged_attention(q, k_cache, v_cache, meta, self.scale)


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                      scale: float, bucket: int = 16) -> torch.Tensor:
    """Causal attention of prompts with nothing cached: `[T, H, D]` packed as `cu_seqlens` says.

    Sequences sorted by length go in buckets of `bucket`, each one causal SDPA padded to its own
    longest (no mask; a sequence never sees another's values, NaN included): padding every
    prompt to the step's longest cost up to 3x the attention of the real tokens (measured on
    `bench/serve.py`'s prompts of 16-256 tokens)."""
    bounds = cu_seqlens.tolist()
    lengths = [b - a for a, b in itertools.pairwise(bounds)]
    if len(lengths) <= bucket:
        return padded_causal_attention(q, k, v, lengths, scale)
    order = sorted(range(len(lengths)), key=lengths.__getitem__)
    out = torch.empty_like(q)
    for i in range(0, len(order), bucket):
        members = order[i:i + bucket]
        rows = torch.cat([torch.arange(bounds[s], bounds[s + 1], device=q.device) for s in members])
        out[rows] = padded_causal_attention(q[rows], k[rows], v[rows], [lengths[s] for s in members], scale)
    return out

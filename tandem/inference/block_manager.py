"""Paged KV-cache bookkeeping: fixed-size blocks, ref counts, block tables, prefix caching, CoW.

Only ids move here; the KV tensors live in the model runner. Prefix caching: every *full* block is
keyed by a chained hash, hash(previous block's hash, its tokens), so equal keys mean equal tokens
from position 0 up to the block's end and therefore equal KV. A freed block keeps its hash while it
sits on the free list (least recently freed is reused first), so a later prompt with the same
prefix revives it instead of recomputing. Blocks are written only at their first free slot; a block
shared by forked samples is copied before it is written (copy-on-write), and full blocks are never
written again, so a shared full block is safe.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence as Tokens
from dataclasses import dataclass

from tandem.inference.sequence import Sequence


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    hash: int | None = None  # set once the block is full (and the chain to it is known)
    token_ids: tuple[int, ...] = ()


def chain_hash(prev: int | None, tokens: Tokens[int]) -> int:
    return hash((prev, tuple(tokens)))


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        self.block_size = block_size
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_ids: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))  # ordered set
        self.hash_to_block: dict[int, int] = {}
        # (src, dst) block copies the model runner must do before the next forward (copy-on-write).
        self.pending_copies: list[tuple[int, int]] = []

    # ------------------------------------------------------------------------------ counters
    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_ids)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        return len(self.hash_to_block)

    # ------------------------------------------------------------------------------ internals
    def _take_free(self) -> Block:
        block_id, _ = self.free_ids.popitem(last=False)
        self.forget([block_id])  # evict: its content is about to be overwritten
        block = self.blocks[block_id]
        block.ref_count = 1
        return block

    def _register(self, block: Block, h: int, tokens: Tokens[int]) -> None:
        block.hash, block.token_ids = h, tuple(tokens)
        self.hash_to_block[h] = block.block_id

    def _release(self, block_id: int) -> None:
        block = self.blocks[block_id]
        block.ref_count -= 1
        assert block.ref_count >= 0, f"block {block_id} released twice"
        if block.ref_count == 0:
            self.free_ids[block_id] = None
            self.pending_copies = [c for c in self.pending_copies if c[1] != block_id]

    # ------------------------------------------------------------------------------ prefill
    def can_allocate(self, seq: Sequence) -> bool:
        # Conservative: ignores prefix hits, so a sequence that was admitted can always run.
        return self.num_free_blocks >= seq.num_blocks(self.block_size)

    def allocate(self, seq: Sequence) -> None:
        """Give `seq` a block for each of its tokens, reusing cached full blocks of its prefix.

        Sets `seq.num_computed_tokens` to the reused prefix. The block holding the last token is
        never reused, so at least one token is computed and yields the logits to sample from.
        """
        assert not seq.block_table, f"sequence {seq.rid} already has blocks"
        bs, h, hit = self.block_size, None, True
        reusable = (len(seq) - 1) // bs  # full blocks strictly before the last token
        seq.num_computed_tokens = 0
        for i in range(seq.num_blocks(bs)):
            tokens = seq.block_tokens(i, bs)
            h = chain_hash(h, tokens) if len(tokens) == bs else None
            cached = self.hash_to_block.get(h) if (hit and i < reusable and h is not None) else None
            if cached is not None and self.blocks[cached].token_ids == tuple(tokens):
                block = self.blocks[cached]
                if block.ref_count == 0:
                    del self.free_ids[cached]
                block.ref_count += 1
                seq.num_computed_tokens += bs
            else:
                hit = False
                block = self._take_free()
                if h is not None:
                    self._register(block, h, tokens)  # computed by this very step's forward
            seq.block_table.append(block.block_id)

    # ------------------------------------------------------------------------------ decode
    def _blocks_needed_to_append(self, seq: Sequence) -> int:
        pos = len(seq) - 1  # the slot the next forward writes
        if pos // self.block_size == len(seq.block_table):
            return 1
        return int(self.blocks[seq.block_table[-1]].ref_count > 1)  # copy-on-write

    def can_append(self, seq: Sequence) -> bool:
        return self.num_free_blocks >= self._blocks_needed_to_append(seq)

    def append_slot(self, seq: Sequence) -> None:
        """Make the slot of `seq`'s last token writable; register the block's hash if it fills."""
        bs, pos = self.block_size, len(seq) - 1
        i = pos // bs
        if i == len(seq.block_table):
            seq.block_table.append(self._take_free().block_id)
        elif (last := self.blocks[seq.block_table[i]]).ref_count > 1:
            new = self._take_free()
            self.pending_copies.append((last.block_id, new.block_id))
            last.ref_count -= 1
            seq.block_table[i] = new.block_id
        if (pos + 1) % bs == 0:
            prev = self.blocks[seq.block_table[i - 1]].hash if i > 0 else None
            if i == 0 or prev is not None:  # after a flush the chain is unknown: leave it uncached
                tokens = seq.block_tokens(i, bs)
                self._register(self.blocks[seq.block_table[i]], chain_hash(prev, tokens), tokens)

    def num_shared_blocks(self, seq: Sequence) -> int:
        """Leading blocks of `seq` that other sequences also hold (ref count > 1): its shared prefix."""
        n = 0
        for block_id in seq.block_table:
            if self.blocks[block_id].ref_count < 2:
                break
            n += 1
        return n

    # ------------------------------------------------------------------------------ lifecycle
    def fork(self, parent: Sequence, child: Sequence) -> None:
        """`child` shares every block of `parent` (its prompt KV is computed once)."""
        assert not child.block_table
        for block_id in parent.block_table:
            self.blocks[block_id].ref_count += 1
        child.block_table = list(parent.block_table)

    def free(self, seq: Sequence) -> None:
        # Tail first, so the prefix's blocks are freed last and evicted last.
        for block_id in reversed(seq.block_table):
            self._release(block_id)
        seq.block_table = []
        seq.num_computed_tokens = 0

    def forget(self, block_ids: list[int]) -> None:
        """Drop these blocks from the prefix cache (their content no longer matches their key)."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.hash is not None and self.hash_to_block.get(block.hash) == block_id:
                del self.hash_to_block[block.hash]
            block.hash, block.token_ids = None, ()

    def flush(self) -> None:
        """Forget the prefix cache (e.g. after a weight update, when cached KV is stale)."""
        self.hash_to_block.clear()
        for block in self.blocks:
            block.hash, block.token_ids = None, ()

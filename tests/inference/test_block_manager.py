"""Block manager bookkeeping: allocation, prefix reuse, fork + copy-on-write, no leaks."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tandem.inference.block_manager import BlockManager
from tandem.inference.sampling_params import SamplingParams
from tandem.inference.sequence import Sequence


def seq(tokens: list[int]) -> Sequence:
    return Sequence("r", list(tokens), SamplingParams(), torch.Generator())


def test_allocate_free_and_prefix_reuse():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = seq(list(range(10)))  # 2 full blocks + 1 partial
    bm.allocate(a)
    assert len(a.block_table) == 3 and a.num_computed_tokens == 0
    assert bm.num_free_blocks == 5 and bm.num_cached_blocks == 2
    b = seq([*range(9), 99])  # same first 2 blocks
    bm.allocate(b)
    assert b.block_table[:2] == a.block_table[:2] and b.num_computed_tokens == 8
    assert bm.num_used_blocks == 4
    bm.free(a)
    bm.free(b)
    assert bm.num_free_blocks == 8
    # Freed blocks keep their hashes: a third sequence revives them from the free list.
    c = seq([*range(8), 7, 7])
    bm.allocate(c)
    assert c.num_computed_tokens == 8
    bm.free(c)
    bm.flush()
    d = seq(list(range(10)))
    bm.allocate(d)
    assert d.num_computed_tokens == 0 and bm.num_cached_blocks == 2


def test_last_token_is_always_computed():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = seq(list(range(8)))
    bm.allocate(a)
    b = seq(list(range(8)))  # identical, block-aligned: the block holding the last token is recomputed
    bm.allocate(b)
    assert b.num_computed_tokens == 4 and b.block_table[0] == a.block_table[0]
    assert b.block_table[1] != a.block_table[1]


def test_fork_shares_blocks_and_copies_on_write():
    bm = BlockManager(num_blocks=8, block_size=4)
    parent = seq(list(range(6)))
    bm.allocate(parent)
    parent.token_ids.append(100)
    child = parent.fork(1, torch.Generator())
    child.token_ids[-1] = 200
    bm.fork(parent, child)
    assert bm.num_used_blocks == 2
    bm.append_slot(parent)  # writes position 6 in the shared partial block -> private copy
    assert bm.pending_copies == [(child.block_table[1], parent.block_table[1])]
    bm.append_slot(child)  # now the sole owner: writes in place
    assert len(bm.pending_copies) == 1 and bm.num_used_blocks == 3
    assert parent.block_table[0] == child.block_table[0]
    bm.free(parent)
    bm.free(child)
    assert bm.num_free_blocks == 8


ops = st.lists(
    st.tuples(st.sampled_from(["new", "append", "fork", "free"]), st.integers(0, 50), st.integers(1, 30)),
    max_size=60,
)


@settings(max_examples=150, deadline=None)
@given(ops)
def test_random_operations_keep_ref_counts_consistent(program):
    bm = BlockManager(num_blocks=24, block_size=4)
    live: list[Sequence] = []
    for op, pick, length in program:
        if op == "new":
            s = seq([pick % 3] * length)  # few distinct prompts, so prefixes are shared
            if bm.can_allocate(s):
                bm.allocate(s)
                live.append(s)
        elif live:
            s = live[pick % len(live)]
            if op == "append":
                s.token_ids.append(pick)
                if bm.can_append(s):
                    bm.append_slot(s)
                else:
                    s.token_ids.pop()
            elif op == "fork":
                child = s.fork(1, torch.Generator())
                bm.fork(s, child)
                live.append(child)
            else:
                bm.free(s)
                live.remove(s)
        bm.pending_copies.clear()
        # Every block's ref count is the number of live block tables holding it; free <=> ref 0.
        refs = [0] * bm.num_blocks
        for s in live:
            assert len(s.block_table) == s.num_blocks(bm.block_size)
            for b in s.block_table:
                refs[b] += 1
        assert refs == [b.ref_count for b in bm.blocks]
        assert set(bm.free_ids) == {i for i, r in enumerate(refs) if r == 0}
        for h, b in bm.hash_to_block.items():
            assert bm.blocks[b].hash == h
    for s in live:
        bm.free(s)
    assert bm.num_free_blocks == bm.num_blocks

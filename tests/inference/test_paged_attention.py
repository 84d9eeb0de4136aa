"""Decode (cascade, chunked) attention equals plain attention over each sequence's keys, in
PyTorch and in the CPU kernel (`tandem/inference/csrc/paged_attention.cpp`)."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from tandem.inference import cpu_kernels
from tandem.inference.paged_attention import (
    AttentionMetadata,
    _choose_chunk,
    build_decode_metadata,
    build_prefill_pass,
    decode_attention,
    kernel_attention,
    paged_attention,
    prefill_attention,
    write_kv,
)


def stored(keys: torch.Tensor) -> torch.Tensor:
    """Keys `[H_kv, blocks, block_size, D]` as the key cache stores them (transposed per block)."""
    return keys.transpose(-1, -2).contiguous()


def _reference(q, k_cache, v_cache, tables, lens, scale):
    """Per sequence, float64: softmax(q k^T * scale) v over its first `len` keys."""
    h_kv, d = k_cache.shape[0], k_cache.shape[-1]
    g = q.shape[1] // h_kv
    outs = []
    for i, (table, n) in enumerate(zip(tables, lens, strict=True)):
        keys = k_cache[:, table].reshape(h_kv, -1, d)[:, :n].double()
        values = v_cache[:, table].reshape(h_kv, -1, d)[:, :n].double()
        qi = q[i].double().view(h_kv, g, d)
        w = torch.softmax(qi @ keys.transpose(-1, -2) * scale, dim=-1)
        outs.append((w @ values).reshape(-1, d))
    return torch.stack(outs)


def _workload(seed: int, bs: int, groups: list[int], singles: int, num_blocks: int = 400):
    """Groups of sequences sharing a prefix of full blocks (as forked samples do), plus singles."""
    rng = random.Random(seed)
    free = list(range(1, num_blocks))
    rng.shuffle(free)
    tables, lens, shared = [], [], []
    for size in groups:
        prefix = [free.pop() for _ in range(rng.randint(1, 9))]
        for _ in range(size):
            own = rng.randint(1, 40)  # keys after the shared prefix (at least the newest one)
            tables.append(prefix + [free.pop() for _ in range(-(-own // bs))])
            lens.append(len(prefix) * bs + own)
            shared.append(len(prefix))
    for _ in range(singles):
        n = rng.randint(1, 150)
        tables.append([free.pop() for _ in range(-(-n // bs))])
        lens.append(n)
        shared.append(0)
    order = list(range(len(tables)))
    rng.shuffle(order)  # group members are not adjacent in a real batch
    return [tables[i] for i in order], [lens[i] for i in order], [shared[i] for i in order]


def test_the_cpu_kernel_builds_on_this_machine():
    """The kernel tests below would otherwise test the PyTorch path twice: a machine that cannot
    build it (no g++ or ninja) fails here, saying so, instead of passing quietly."""
    assert cpu_kernels.paged_attention() is not None, (
        "the CPU paged attention kernel did not build: see the warning logged by tandem.inference.cpu_kernels "
        "(make test-deps installs g++ and ninja)")


@pytest.mark.parametrize("kernel", [False, True], ids=["torch", "kernel"])
@pytest.mark.parametrize("heads", [(4, 2), (8, 8), (6, 1)])
@pytest.mark.parametrize("groups,singles", [([4] * 6, 0), ([4, 4, 3, 2, 5, 1, 16], 7), ([], 9), ([2], 0)])
def test_decode_attention_equals_plain_attention(heads, groups, singles, kernel):
    torch.manual_seed(0)
    n_heads, h_kv = heads
    bs, d, num_blocks = 16, 32, 400
    tables, lens, shared = _workload(len(groups) + singles, bs, groups, singles, num_blocks)
    k_cache = torch.randn(h_kv, num_blocks, bs, d)
    v_cache = torch.randn(h_kv, num_blocks, bs, d)
    q = torch.randn(len(tables), n_heads, d)
    scale = d**-0.5
    meta = build_decode_metadata(tables, lens, shared, bs, torch.device("cpu"), kernel=kernel)
    if groups and max(groups) > 1:
        assert meta.prefix, "shared prefixes should go through a prefix pass"
    out = decode_attention(q, stored(k_cache), v_cache, meta, scale)
    ref = _reference(q, k_cache, v_cache, tables, lens, scale)
    assert (out.double() - ref).abs().max() < 1e-6

    # The prefill path (one query per sequence) agrees too.
    width = max(len(t) for t in tables)
    pmeta = AttentionMetadata(
        slot_mapping=torch.zeros(0, dtype=torch.long),
        cu_seqlens_q=torch.arange(len(tables) + 1, dtype=torch.int32),
        context_lens=torch.tensor(lens, dtype=torch.int32),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables]),
        max_query_len=1, max_context_len=max(lens), no_cached_prefix=False,
    )
    assert (paged_attention(q, stored(k_cache), v_cache, pmeta, scale) - out).abs().max() < 1e-6


@pytest.mark.parametrize("kernel", [False, True], ids=["torch", "kernel"])
def test_wrong_shared_counts_stay_exact(kernel):
    """Shared counts are hints: sequences group only on identical block ids, and a count past the
    last block is capped, so an over-estimate never changes the result."""
    torch.manual_seed(1)
    bs, d = 4, 16
    tables = [[1, 2, 3], [1, 2, 4], [1, 5, 6], [7, 8]]
    lens = [10, 12, 9, 5]
    k_cache, v_cache = torch.randn(2, 9, bs, d), torch.randn(2, 9, bs, d)
    q = torch.randn(4, 4, d)
    ref = _reference(q, k_cache, v_cache, tables, lens, 0.3)
    for shared in ([9, 9, 9, 9], [2, 2, 1, 0], [1, 1, 1, 1], [0, 0, 0, 0]):
        meta = build_decode_metadata(tables, lens, shared, bs, torch.device("cpu"), kernel=kernel)
        assert (decode_attention(q, stored(k_cache), v_cache, meta, 0.3).double() - ref).abs().max() < 1e-6


@pytest.mark.parametrize("groups,singles", [([4] * 6, 3), ([], 5)])
def test_kernel_on_a_bfloat16_cache_rounds_once(groups, singles):
    """A bf16 cache and query: the kernel widens what it reads and rounds only its output, so it is
    within half a bf16 ulp of the float64 answer from the same bf16 values (PyTorch's bf16 path,
    which rounds scores and probabilities too, is looser)."""
    torch.manual_seed(2)
    bs, d, h_kv, n_heads = 16, 64, 2, 4
    tables, lens, shared = _workload(11, bs, groups, singles)
    k_cache = torch.randn(h_kv, 400, bs, d).bfloat16()
    v_cache = torch.randn(h_kv, 400, bs, d).bfloat16()
    q = torch.randn(len(tables), n_heads, d).bfloat16()
    meta = build_decode_metadata(tables, lens, shared, bs, torch.device("cpu"), kernel=True)
    out = decode_attention(q, stored(k_cache), v_cache, meta, d**-0.5)
    assert out.dtype == torch.bfloat16
    ref = _reference(q, k_cache, v_cache, tables, lens, d**-0.5)
    exact = ref.bfloat16().double()  # the correctly rounded answer
    ulp = (ref.abs().clamp(min=1e-30).log2().floor() - 7).exp2()  # bf16 spacing at each value
    assert ((out.double() - ref).abs() <= ulp * 0.5 + 1e-6).all()
    assert (out.double() == exact).float().mean() > 0.95


@pytest.mark.parametrize("num_seqs", [5, 40])
def test_prefill_attention_equals_per_sequence_causal_attention(num_seqs):
    """Length buckets (40 prompts: 3 buckets, each padded to its own longest) give every prompt
    the causal attention it gets alone; a NaN in one prompt's keys stays in that prompt."""
    rng = random.Random(num_seqs)
    lengths = [rng.randint(1, 70) for _ in range(num_seqs)]
    cu = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)
    torch.manual_seed(3)
    q, k, v = torch.randn(int(cu[-1]), 6, 16), torch.randn(int(cu[-1]), 2, 16), torch.randn(int(cu[-1]), 2, 16)
    out = prefill_attention(q, k, v, cu, 0.25)
    for i, (a, b) in enumerate(itertools.pairwise(cu.tolist())):
        qi, ki, vi = (x[a:b].transpose(0, 1).double() for x in (q, k, v))
        ki, vi = ki.repeat_interleave(3, 0), vi.repeat_interleave(3, 0)
        mask = torch.ones(b - a, b - a, dtype=torch.bool).tril()
        w = (qi @ ki.transpose(-1, -2) * 0.25).masked_fill(~mask, float("-inf")).softmax(-1)
        assert (out[a:b].double() - (w @ vi).transpose(0, 1)).abs().max() < 1e-5, f"sequence {i}"
    k[int(cu[1]) - 1] = float("nan")  # the first prompt's last key
    poisoned = prefill_attention(q, k, v, cu, 0.25)
    assert poisoned[int(cu[1]) - 1].isnan().all()
    assert torch.equal(poisoned[int(cu[1]):], out[int(cu[1]):])


@pytest.mark.parametrize("kernel", [False, True], ids=["torch", "kernel"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kv_stores_keys_transposed_per_block(kernel, dtype):
    """Slot s = block * block_size + offset: its value row at [:, block, offset], its key column at
    [:, block, :, offset] (the layout the CPU kernel reads as vectors); the kernel's one-pass write
    (from strided k/v, as the model hands them over) and PyTorch's agree."""
    h, blocks, bs, d = 2, 5, 4, 3
    k_cache, v_cache = torch.zeros(h, blocks, d, bs, dtype=dtype), torch.zeros(h, blocks, bs, d, dtype=dtype)
    slots = torch.tensor([6, 0, 19])
    k, v = torch.randn(h, 3, d).to(dtype).transpose(0, 1), torch.randn(3, h, d).to(dtype)
    write_kv(k, v, k_cache, v_cache, slots, cpu_kernels.paged_attention() if kernel else None)
    for i, s in enumerate(slots.tolist()):
        assert torch.equal(k_cache[:, s // bs, :, s % bs], k[i]) and torch.equal(v_cache[:, s // bs, s % bs], v[i])
    assert int((k_cache != 0).sum()) == int((v_cache != 0).sum()) == 3 * h * d


def test_chunk_choice():
    assert _choose_chunk([3, 3, 3]) == 3  # equal lengths: one chunk per task
    assert _choose_chunk([1, 16]) < 16  # padding 1 -> 16 would double the keys read
    assert _choose_chunk([1]) == 1


def test_engine_cascade_equals_unshared_decode(qwen3_dir, monkeypatch):
    """End to end: n-sample groups decoded with the prefix pass give the same tokens and logprobs
    as the same requests decoded with every sequence attending alone, and as PyTorch's passes in
    place of the CPU kernel; logprobs agree to fp32 rounding
    through the layers (the test model's logprobs reach ~-20, where one float32 ulp is ~2e-6)."""
    from tandem.inference.engine import LLMEngine
    from tandem.inference.sampling_params import SamplingParams
    from tests.inference.conftest import prompts

    batch = prompts([37, 5, 64, 20], seed=21)
    params = SamplingParams(max_new_tokens=24, n=4, temperature=1.0, seed=3, ignore_eos=True)

    def outputs(engine):
        return {(o.rid, o.index): o for o in engine.generate(batch, params)}

    grouped_engine = LLMEngine(qwen3_dir, kv_cache_tokens=4096, block_size=8, max_num_seqs=64)
    calls = []
    original = grouped_engine.block_manager.num_shared_blocks
    monkeypatch.setattr(grouped_engine.block_manager, "num_shared_blocks", lambda s: calls.append(1) or original(s))
    grouped = outputs(grouped_engine)
    assert calls
    alone_engine = LLMEngine(qwen3_dir, kv_cache_tokens=4096, block_size=8, max_num_seqs=64)
    monkeypatch.setattr(alone_engine.block_manager, "num_shared_blocks", lambda s: 0)
    alone = outputs(alone_engine)
    torch_engine = LLMEngine(qwen3_dir, kv_cache_tokens=4096, block_size=8, max_num_seqs=64)
    assert grouped_engine.runner.attention_kernel and torch_engine.runner.attention_kernel
    torch_engine.runner.attention_kernel = False  # PyTorch's chunked passes instead of the CPU kernel
    in_torch = outputs(torch_engine)
    assert grouped.keys() == alone.keys() == in_torch.keys()
    for key, out in grouped.items():
        for other in (alone[key], in_torch[key]):
            assert out.output_ids == other.output_ids
            assert max(abs(a - b) for a, b in zip(out.output_logprobs, other.output_logprobs, strict=True)) < 1e-5


def test_the_kernel_refuses_passes_that_name_what_is_not_there():
    """Catches the kernel reading past qv or past the cache on bad metadata instead of refusing it."""
    kernel = cpu_kernels.paged_attention()
    assert kernel is not None
    qv = torch.randn(2, 1, 1, 16)
    k_cache, v_cache = torch.randn(1, 4, 16, 16), torch.randn(1, 4, 16, 16)
    ok = [torch.tensor([[0], [1]]), torch.tensor([[1], [2]]), torch.tensor([3, 5])]
    out = kernel.attend(qv, k_cache, v_cache, [ok])
    assert out.shape == (2, 1, 1, 16) and bool(out.isfinite().all())
    with pytest.raises(RuntimeError, match="sequence 2, outside"):
        kernel.attend(qv, k_cache, v_cache, [[torch.tensor([[0], [2]]), ok[1], ok[2]]])
    with pytest.raises(RuntimeError, match="block id 9 out of range"):
        kernel.attend(qv, k_cache, v_cache, [[ok[0], torch.tensor([[1], [9]]), ok[2]]])
    with pytest.raises(RuntimeError, match="has no key"):
        kernel.attend(qv, k_cache, v_cache, [[ok[0], ok[1], torch.tensor([3, 0])]])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,rows", [((6, 2), 16), ((4, 4), 3), ((8, 1), 1)])
def test_kernel_prefill_equals_causal_attention_over_cache_and_new_tokens(dtype, heads, rows):
    """Catches a wrong causal limit (a token seeing its successors, or missing its own key or the
    cached prefix), rows mixed up across runs and sequences, and padding rows written: the kernel's
    prefill of new tokens after cached prefixes of every length (none, a partial block, whole
    blocks) equals float64 causal attention token by token, and PyTorch's paged_attention too."""
    torch.manual_seed(5)
    n_heads, h_kv = heads
    bs, d, num_blocks = 16, 32, 200
    rng = random.Random(rows)
    cached = [0, 0, 5, 16, 33, 0, 70]
    new = [1, 40, 17, 16, 9, 100, 3]
    free = list(range(1, num_blocks))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(-(-(c + n) // bs))] for c, n in zip(cached, new, strict=True)]
    lens = [c + n for c, n in zip(cached, new, strict=True)]
    k_cache = torch.randn(h_kv, num_blocks, bs, d).to(dtype)
    v_cache = torch.randn(h_kv, num_blocks, bs, d).to(dtype)
    q = torch.randn(sum(new), n_heads, d).to(dtype)
    scale = d**-0.5
    p = build_prefill_pass(tables, lens, new, torch.device("cpu"), rows=rows)
    out = kernel_attention(q, stored(k_cache), v_cache, [p], scale)
    assert out.dtype == dtype and out.shape == q.shape
    g = n_heads // h_kv
    first = 0
    for table, context, n in zip(tables, lens, new, strict=True):
        keys = k_cache[:, table].reshape(h_kv, -1, d).double()
        values = v_cache[:, table].reshape(h_kv, -1, d).double()
        for t in range(n):
            visible = context - n + t + 1
            qi = q[first + t].double().view(h_kv, g, d)
            w = torch.softmax(qi @ keys[:, :visible].transpose(-1, -2) * scale, dim=-1)
            ref = (w @ values[:, :visible]).reshape(-1, d)
            tol = 1e-5 if dtype == torch.float32 else 1e-2  # bf16: the output is rounded once
            assert (out[first + t].double() - ref).abs().max() < tol, (context, n, t)
        first += n
    width = max(len(t) for t in tables)
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(0, dtype=torch.long),
        cu_seqlens_q=torch.tensor([0, *itertools.accumulate(new)], dtype=torch.int32),
        context_lens=torch.tensor(lens, dtype=torch.int32),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables]),
        max_query_len=max(new), max_context_len=max(lens), no_cached_prefix=False,
    )
    torch_out = paged_attention(q, stored(k_cache), v_cache, meta, scale)
    assert (torch_out.double() - out.double()).abs().max() < (1e-5 if dtype == torch.float32 else 2e-2)


def test_the_kernel_refuses_row_keys_past_its_task():
    kernel = cpu_kernels.paged_attention()
    assert kernel is not None
    qv = torch.randn(2, 1, 1, 16)
    k_cache, v_cache = torch.randn(1, 4, 16, 16), torch.randn(1, 4, 16, 16)
    rows, blocks, nkeys = torch.tensor([[0, 1]]), torch.tensor([[1, 2]]), torch.tensor([20])
    out = kernel.attend(qv, k_cache, v_cache, [[rows, blocks, nkeys, torch.tensor([[19, 20]])]])
    assert bool(out.isfinite().all())
    with pytest.raises(RuntimeError, match=r"outside 1\.\.its task's nkeys"):
        kernel.attend(qv, k_cache, v_cache, [[rows, blocks, nkeys, torch.tensor([[19, 21]])]])
    with pytest.raises(RuntimeError, match="more keys than its blocks hold"):
        kernel.attend(qv, k_cache, v_cache, [[rows, blocks, torch.tensor([33])]])


@pytest.mark.parametrize("takes_gqa", [True, False], ids=["torch>=2.12", "torch-2.11"])
@pytest.mark.parametrize("heads", [(4, 2), (6, 1)])
def test_gathered_keys_hand_the_varlen_kernel_each_sequences_cache(monkeypatch, heads, takes_gqa):
    """CUDA's path (`varlen_paged_attention`), with torch's varlen contract standing in for the
    flash kernel on CPU (tests/varlen_reference.py): decodes over shared and private blocks, and
    prefills of new tokens after cached prefixes of every length, equal float64 attention over
    each sequence's keys read through its block table."""
    import tandem.models.common.attention as attention
    from tandem.inference.paged_attention import build_gathered_keys, varlen_paged_attention
    from tests.varlen_reference import reference_varlen

    calls: list[dict] = []
    monkeypatch.setattr(attention, "VARLEN", (reference_varlen(calls, takes_gqa), takes_gqa))
    torch.manual_seed(7)
    n_heads, h_kv = heads
    bs, d, num_blocks = 16, 32, 400
    k_cache, v_cache = torch.randn(h_kv, num_blocks, bs, d), torch.randn(h_kv, num_blocks, bs, d)
    scale = d**-0.5

    tables, lens, _ = _workload(3, bs, [4, 2], 5, num_blocks)  # decode: one query per sequence
    q = torch.randn(len(tables), n_heads, d)
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(0, dtype=torch.long), cu_seqlens_q=torch.arange(len(tables) + 1, dtype=torch.int32),
        context_lens=torch.tensor(lens, dtype=torch.int32), block_tables=None, max_query_len=1,
        max_context_len=max(lens), no_cached_prefix=False,
        gathered=build_gathered_keys(tables, lens, bs, torch.device("cpu")))
    out = varlen_paged_attention(q, stored(k_cache), v_cache, meta, scale, batch_invariant=True)
    assert (out.double() - _reference(q, k_cache, v_cache, tables, lens, scale)).abs().max() < 1e-5
    assert calls[-1]["max_k"] == max(lens) and calls[-1]["splits"] == (1 if takes_gqa else None)

    cached, new = [0, 5, 16, 33, 70], [40, 17, 16, 1, 3]  # prefill after cached prefixes
    lens = [c + n for c, n in zip(cached, new, strict=True)]
    free = list(range(1, num_blocks))
    tables = [[free.pop() for _ in range(-(-n // bs))] for n in lens]
    q = torch.randn(sum(new), n_heads, d)
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(0, dtype=torch.long),
        cu_seqlens_q=torch.tensor([0, *itertools.accumulate(new)], dtype=torch.int32),
        context_lens=torch.tensor(lens, dtype=torch.int32), block_tables=None, max_query_len=max(new),
        max_context_len=max(lens), no_cached_prefix=False,
        gathered=build_gathered_keys(tables, lens, bs, torch.device("cpu")))
    out = varlen_paged_attention(q, stored(k_cache), v_cache, meta, scale)
    first = 0
    for table, context, n in zip(tables, lens, new, strict=True):
        for t in range(n):  # token t of the new ones sees the keys up to its own position
            visible = context - n + t + 1
            ref = _reference(q[first + t:first + t + 1], k_cache, v_cache, [table], [visible], scale)
            assert (out[first + t].double() - ref[0]).abs().max() < 1e-5, (context, n, t)
        first += n


def test_engine_on_the_varlen_path_serves_what_the_cpu_kernel_serves(qwen3_dir, monkeypatch):
    """The model runner's CUDA path end to end on CPU (torch's varlen contract standing in for the
    flash kernel): prefills, forked samples sharing prefix blocks, and decodes give the same tokens
    and logprobs as the CPU kernel, to fp32 rounding through the layers."""
    import tandem.models.common.attention as attention
    from tandem.inference.engine import LLMEngine
    from tandem.inference.sampling_params import SamplingParams
    from tests.inference.conftest import prompts
    from tests.varlen_reference import reference_varlen

    batch = prompts([37, 5, 64, 20], seed=22)
    params = SamplingParams(max_new_tokens=16, n=3, temperature=1.0, seed=4, ignore_eos=True)

    def outputs(engine):
        return {(o.rid, o.index): o for o in engine.generate(batch, params)}

    want = outputs(LLMEngine(qwen3_dir, kv_cache_tokens=4096, block_size=8, max_num_seqs=64))
    calls: list[dict] = []
    monkeypatch.setattr(attention, "VARLEN", (reference_varlen(calls, True), True))
    engine = LLMEngine(qwen3_dir, kv_cache_tokens=4096, block_size=8, max_num_seqs=64)
    assert not engine.runner.varlen  # CPU: the kernel's path unless asked
    engine.runner.varlen, engine.runner.attention_kernel = True, False
    got = outputs(engine)
    assert calls and any(c["max_q"] > 1 for c in calls) and any(c["max_q"] == 1 for c in calls)
    assert got.keys() == want.keys()
    for key, out in got.items():
        assert out.output_ids == want[key].output_ids
        assert max(abs(a - b) for a, b in zip(out.output_logprobs, want[key].output_logprobs, strict=True)) < 1e-5

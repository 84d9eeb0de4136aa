"""Engine behaviour: batching without leaks, prefix sharing, preemption, aborts, finish reasons,
seeding, streaming and the control surface (flush, weights, stats)."""

from __future__ import annotations

import pytest
import torch

from tandem.inference.engine import LLMEngine
from tandem.inference.errors import EngineBusyError, RequestError
from tandem.inference.request import GenerationRequest
from tandem.inference.sampling_params import SamplingParams
from tests.inference.conftest import OVERFLOW_TOKEN, prompts

GREEDY = SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(qwen3_dir):
    return LLMEngine(qwen3_dir, kv_cache_tokens=2048, block_size=8, max_num_seqs=16)


def assert_idle(engine: LLMEngine) -> None:
    assert not engine.has_unfinished()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def run(engine: LLMEngine) -> dict[tuple[str, int], object]:
    outs = {}
    while engine.has_unfinished():
        outs.update({(o.rid, o.index): o for o in engine.step()})
    return outs


def test_many_mixed_requests_leak_no_blocks(engine):
    gen = torch.Generator().manual_seed(0)
    outs = {}
    lengths = torch.randint(1, 60, (40,), generator=gen).tolist()
    for i, ids in enumerate(prompts(lengths, seed=5)):
        n = 1 + i % 3
        max_new = int(torch.randint(1, 30, (1,), generator=gen))
        engine.add_request(GenerationRequest(f"mix-{i}", ids, SamplingParams(max_new_tokens=max_new, n=n, seed=i), return_logprob=True))
        if i % 4 == 0:
            outs.update({(o.rid, o.index): o for o in engine.step()})  # join a running batch
        if i % 10 == 9:
            engine.abort(f"mix-{i - 1}")
    outs.update(run(engine))
    assert len(outs) == sum(1 + i % 3 for i in range(40))
    assert_idle(engine)
    assert engine.stats()["running"] == engine.stats()["waiting"] == 0


def test_n_samples_share_the_prompt_blocks(engine):
    ids = prompts([37], seed=6)[0]  # 4 full blocks of 8 + a partial one
    engine.flush_cache()
    engine.add_request(GenerationRequest("grp", ids, SamplingParams(max_new_tokens=4, n=4, seed=11, ignore_eos=True)))
    engine.step()  # prefill once, fork into 4 samples
    assert engine.stats()["running"] == 4
    assert engine.block_manager.num_used_blocks == 5  # not 4 * 5
    engine.step()  # each sample writes its own token: the partial block is copied for 3 of them
    assert engine.block_manager.num_used_blocks == 4 + 4
    run(engine)
    assert_idle(engine)


def test_forked_samples_equal_separate_requests(engine):
    ids = prompts([21], seed=7)[0]
    params = {"max_new_tokens": 20, "temperature": 0.9, "top_k": 40, "ignore_eos": True}
    forked = engine.generate([ids], SamplingParams(n=4, seed=100, **params))
    engine.flush_cache()
    alone = engine.generate([ids] * 4, [SamplingParams(seed=100 + i, **params) for i in range(4)])
    assert [o.output_ids for o in forked] == [o.output_ids for o in alone]
    for f, a in zip(forked, alone, strict=True):
        assert max(abs(x - y) for x, y in zip(f.output_logprobs, a.output_logprobs, strict=True)) < 1e-5
    assert len({tuple(o.output_ids) for o in forked}) > 1  # the samples really differ
    assert_idle(engine)


def test_preemption_by_recompute_matches_a_large_cache(qwen3_dir, engine):
    batch = prompts([30, 9, 25, 17, 40, 3], seed=8)
    params = [SamplingParams(max_new_tokens=40, temperature=0.0, ignore_eos=True),
              SamplingParams(max_new_tokens=40, temperature=1.0, seed=5, ignore_eos=True)]
    small = LLMEngine(qwen3_dir, kv_cache_tokens=96, block_size=8)  # 12 blocks; one request needs <= 10
    for p in params:
        engine.flush_cache()
        expected = engine.generate(batch, p)
        got = small.generate(batch, p)
        assert [o.output_ids for o in got] == [o.output_ids for o in expected]
    assert small.stats()["preemptions"] > 0
    assert_idle(small)


def test_abort_while_queued_and_while_running(engine):
    ids = prompts([12], seed=9)[0]
    engine.add_request(GenerationRequest("run-1", ids, GREEDY, return_logprob=True))
    engine.step()
    engine.step()
    engine.step()  # prefill + 2 decodes: 3 tokens
    engine.add_request(GenerationRequest("queued-1", ids, SamplingParams(n=2), return_logprob=True))
    assert sorted(engine.abort(abort_all=True)) == ["queued-1", "run-1"]
    outs = {(o.rid, o.index): o for o in engine.step()}
    running = outs["run-1", 0]
    assert running.finish_reason["type"] == "abort" and running.completion_tokens == 3
    assert len(running.output_logprobs) == 3
    for i in range(2):
        queued = outs["queued-1", i]
        assert queued.finish_reason == {"type": "abort", "message": "Abort before prefill"}  # SGLang's words
        assert queued.output_ids == [] and queued.output_logprobs == []
    assert_idle(engine)


def test_abort_by_rid_prefix(engine):
    for rid in ("a-1", "a-2", "b-1"):
        engine.add_request(GenerationRequest(rid, [11, 12, 13], GREEDY))
    assert sorted(engine.abort("a-")) == ["a-1", "a-2"]
    outs = run(engine)
    assert outs["b-1", 0].finish_reason == {"type": "length", "length": 16}
    assert outs["a-1", 0].finish_reason["type"] == "abort"


def test_finish_reasons(engine):
    ids = prompts([10], seed=10)[0]
    free = engine.generate([ids], GREEDY)[0]
    assert free.finish_reason == {"type": "length", "length": 16} and free.completion_tokens == 16
    target = free.output_ids[5]
    first = free.output_ids.index(target)

    stop_tok = engine.generate([ids], SamplingParams(max_new_tokens=16, temperature=0, stop_token_ids=[target]))[0]
    assert stop_tok.finish_reason == {"type": "stop", "matched": target}
    assert stop_tok.output_ids == free.output_ids[: first + 1]  # the stop token is kept in output_ids

    eos = engine.eos_ids
    engine.eos_ids = frozenset({target})
    try:
        by_eos = engine.generate([ids], SamplingParams(max_new_tokens=16, temperature=0))[0]
        assert by_eos.finish_reason == {"type": "stop", "matched": target}
        assert by_eos.text == engine.detokenizer.decode(free.output_ids[:first], True)  # stop token trimmed
        ignored = engine.generate([ids], SamplingParams(max_new_tokens=16, temperature=0, ignore_eos=True))[0]
        assert ignored.output_ids == free.output_ids
        late = engine.generate([ids], SamplingParams(max_new_tokens=16, temperature=0, min_new_tokens=first + 2))[0]
        assert target not in late.output_ids[: first + 2] and late.completion_tokens >= first + 2
    finally:
        engine.eos_ids = eos
    assert_idle(engine)


def test_stop_string_is_matched_on_text_and_trimmed(engine):
    ids = prompts([14], seed=12)[0]
    free = engine.generate([ids], GREEDY)[0]
    decode = engine.detokenizer.decode
    i = next(i for i in range(2, 16) if (s := decode([free.output_ids[i]], True)).isascii() and s.strip()
             and s not in decode(free.output_ids[:i], True))
    stop = decode([free.output_ids[i]], True)
    out = engine.generate([ids], SamplingParams(max_new_tokens=16, temperature=0, stop=["@@never@@", stop]))[0]
    assert out.finish_reason == {"type": "stop", "matched": stop}
    assert out.output_ids == free.output_ids[: i + 1]
    full = decode(out.output_ids, True)
    assert out.text == full[: full.find(stop)] and stop not in out.text


def test_seeded_sampling_is_reproducible(engine):
    batch = prompts([8, 19], seed=13)
    p = SamplingParams(max_new_tokens=20, temperature=1.0, top_p=0.95, seed=7, ignore_eos=True)
    a = engine.generate(batch, p)
    b = engine.generate(batch[::-1], p)[::-1]  # other order, so other batch rows
    assert [o.output_ids for o in a] == [o.output_ids for o in b]
    c = engine.generate(batch, SamplingParams(max_new_tokens=20, temperature=1.0, seed=8, ignore_eos=True))
    assert [o.output_ids for o in a] != [o.output_ids for o in c]


@pytest.mark.parametrize("top", [0, 3])
def test_streaming_deltas_add_up_to_the_output(engine, top):
    engine.add_request(GenerationRequest("s", [20, 21, 22], GREEDY, return_logprob=True, stream=True, top_logprobs_num=top))
    engine.add_request(GenerationRequest("quiet", [20, 21], GREEDY))
    tokens, logprobs, tops, final = [], [], [], None
    while engine.has_unfinished():
        for o in engine.step():
            final = o if o.rid == "s" else final
        for d in engine.pop_deltas():
            assert d.rid == "s"
            tokens += d.token_ids
            logprobs += d.logprobs
            assert (d.top_logprobs is None) == (top == 0)
            tops += d.top_logprobs or []
    assert final is not None and tokens == final.output_ids and logprobs == final.output_logprobs
    assert tops == (final.output_top_logprobs or [])
    assert all(len(t) == top for t in tops) and len(tops) == (len(tokens) if top else 0)


def test_request_checks(engine):
    limit = engine.max_total_num_tokens
    with pytest.raises(RequestError, match="exceeds the context limit"):
        engine.add_request(GenerationRequest("long", [5] * (limit - 10), SamplingParams(max_new_tokens=11)))
    with pytest.raises(RequestError, match="input_ids"):
        engine.add_request(GenerationRequest("oov", [engine.vocab_size], GREEDY))
    with pytest.raises(RequestError, match="empty"):
        engine.add_request(GenerationRequest("empty", [], GREEDY))
    with pytest.raises(RequestError, match="n=17 exceeds max_num_seqs"):
        engine.add_request(GenerationRequest("many", [5], SamplingParams(n=17)))
    engine.add_request(GenerationRequest("dup", [5, 6], GREEDY))
    with pytest.raises(RequestError, match="already in flight"):
        engine.add_request(GenerationRequest("dup", [5, 6], GREEDY))
    with pytest.raises(EngineBusyError):
        engine.flush_cache()
    run(engine)
    engine.flush_cache()
    assert engine.stats()["cached_blocks"] == 0


def test_non_finite_logits_fail_that_request_only(overflow_dir):
    """A request whose logits turn NaN ends with an "error" finish reason and nothing non-finite in
    its output; requests in the same step, and later ones given its freed blocks, get exactly the
    outputs they get alone (attention reads masked slots too, and 0 * inf is NaN)."""
    healthy = [[20, 30, 40], list(range(11, 20)), list(range(200, 213))]
    cached = list(range(300, 316))  # two full blocks a failing request computes (finite) before its bad token
    alone = [o.output_ids for o in LLMEngine(overflow_dir, kv_cache_tokens=512, block_size=8).generate(
        [*healthy, [*cached, 40, 41]], GREEDY)]
    alone, alone_cached = alone[:-1], alone[-1]
    poison = [OVERFLOW_TOKEN, *range(100, 132)]  # 33 tokens: 5 blocks of 8
    # Same step: the poisoned request comes first, so it holds block 0 (once the prefill padding).
    engine = LLMEngine(overflow_dir, kv_cache_tokens=512, block_size=8)
    outs = engine.generate([poison, *healthy], GREEDY)
    error = outs[0].finish_reason
    assert error["type"] == "error" and "logits were not finite (NaN or inf) at output token 1" in error["message"]
    assert outs[0].output_ids == [] and outs[0].output_logprobs == []
    assert [o.output_ids for o in outs[1:]] == alone
    grouped = engine.generate([poison], SamplingParams(max_new_tokens=4, n=3))
    assert [o.finish_reason["type"] for o in grouped] == ["error"] * 3
    # Its zeroed blocks left the prefix cache: a prompt sharing its first blocks computes them again.
    assert engine.generate([[*cached, OVERFLOW_TOKEN]], GREEDY)[0].finish_reason["type"] == "error"
    assert engine.generate([[*cached, 40, 41]], GREEDY)[0].output_ids == alone_cached
    assert_idle(engine)
    # Later: a cache of 5 blocks, all of them the poisoned request's, then given to each request.
    small = LLMEngine(overflow_dir, kv_cache_tokens=40, block_size=8)
    assert small.generate([poison], SamplingParams(max_new_tokens=1))[0].finish_reason["type"] == "error"
    assert [small.generate([ids], GREEDY)[0].output_ids for ids in healthy] == alone
    assert_idle(small)

"""Inference client against real HTTP fake servers: the interruptible loop, routing and faults."""

from __future__ import annotations

import asyncio
import time

import pytest

from tandem.fleet.adapters import TandemAdapter, UnsupportedOperation, adapter_for
from tandem.rollout import (
    ClientConfig,
    GenerationDeadlineError,
    GenerationParams,
    InferenceClient,
    ModelRequest,
    PromptTooLongError,
    ServerPool,
)
from tests.rollout.conftest import run
from tests.rollout.fake_server import chain, token_logprob

pytestmark = pytest.mark.timeout(60)

PROMPT = [11, 12, 13, 14]


async def generate(client: InferenceClient, req: ModelRequest):
    try:
        return await client.agenerate(req)
    finally:
        await client.aclose()


def test_single_request_matches_server(make_server):
    server = make_server()
    client = InferenceClient([server.address])
    resp = run(generate(client, ModelRequest(PROMPT, GenerationParams(max_new_tokens=12))))
    assert resp.output_ids == chain(PROMPT[-1], 12, 1000)
    assert resp.output_logprobs == [token_logprob(t) for t in resp.output_ids]
    assert resp.output_versions == [0] * 12
    assert resp.finish_reason == "length" and resp.num_calls == 1
    traj = resp.to_trajectory()
    assert traj.input_ids == PROMPT + resp.output_ids
    assert traj.loss_mask == [0] * 4 + [1] * 12 and traj.versions[:4] == [-1] * 4


def test_stop_token(make_server):
    server = make_server()
    stop = chain(PROMPT[-1], 5, 1000)[4]
    resp = run(generate(InferenceClient([server.address]), ModelRequest(PROMPT, GenerationParams(max_new_tokens=50, stop_token_ids=[stop]))))
    assert resp.finish_reason == "stop" and len(resp.output_ids) == 5 and resp.output_ids[-1] == stop


def test_interrupted_generation_resumes_under_new_version(make_server):
    """A pause mid-generation aborts with partial output; the client resubmits prompt + partial to
    the same server, which answers after continue under the new version."""
    servers = {s.address: s for s in (make_server(token_delay_s=0.01), make_server(token_delay_s=0.01))}
    client = InferenceClient(list(servers))
    req = ModelRequest(PROMPT, GenerationParams(max_new_tokens=40))
    server = servers[client.pool.choose(req.rid)]  # where routing sends it (affinity is now set)
    other = next(s for s in servers.values() if s is not server)

    async def scenario():
        task = asyncio.create_task(client.agenerate(req))
        await asyncio.to_thread(server.wait_for_tokens, 8)
        await asyncio.to_thread(server.pause)  # in-flight request answers abort with its partial
        other.pause()
        await asyncio.to_thread(server.wait_for_requests, 2)  # resubmitted; waits inside the server
        server.set_version(1)
        other.set_version(1)
        server.continue_generation()
        other.continue_generation()
        try:
            return await task
        finally:
            await client.aclose()

    resp = run(scenario())
    entries = server.entries(req.rid)
    assert [e.finish for e in entries] == ["abort", "length"]
    assert other.entries(req.rid) == []  # rid affinity: the resubmission came back
    k = len(entries[0].output_ids)
    assert 8 <= k < 40
    assert entries[1].input_ids == PROMPT + entries[0].output_ids  # prompt + partial resubmitted
    assert resp.output_ids == entries[0].output_ids + entries[1].output_ids == chain(PROMPT[-1], 40, 1000)
    assert resp.output_versions == [0] * k + [1] * (40 - k)  # versions change inside the sequence
    assert resp.num_aborts == 1 and resp.finish_reason == "length"
    assert resp.servers == [server.address, server.address]


def test_samples_in_one_call_then_each_unfinished_one_continues_alone(make_server):
    """n samples of one prompt go as one call; paused mid-decode, each sample is resubmitted on its
    own (rid `{rid}-{i}`, prompt + its partial) and keeps the version that sampled each token."""
    server = make_server(token_delay_s=0.01)
    client = InferenceClient([server.address])
    req = ModelRequest(PROMPT, GenerationParams(max_new_tokens=40, seed=5))

    async def scenario():
        task = asyncio.create_task(client.agenerate_samples(req, 3))
        await asyncio.to_thread(server.wait_for_tokens, 3 * 8)
        await asyncio.to_thread(server.pause)
        await asyncio.to_thread(server.wait_for_requests, 1 + 3)  # the three continuations wait inside
        server.set_version(1)
        server.continue_generation()
        try:
            return await task
        finally:
            await client.aclose()

    responses = run(scenario())
    first = server.entries(req.rid)
    assert len(first) == 3 and [e.finish for e in first] == ["abort"] * 3  # one call, three samples
    assert server.num_requests == 1 + 3
    for i, (resp, entry) in enumerate(zip(responses, first, strict=True)):
        k = len(entry.output_ids)
        assert 0 < k < 40
        (rest,) = server.entries(f"{req.rid}-{i}")
        assert rest.input_ids == PROMPT + entry.output_ids and rest.finish == "length"
        assert resp.rid == f"{req.rid}-{i}" and resp.input_ids == PROMPT
        assert resp.output_ids == entry.output_ids + rest.output_ids == chain(PROMPT[-1], 40, 1000)
        assert resp.output_logprobs == [token_logprob(t) for t in resp.output_ids]
        assert resp.output_versions == [0] * k + [1] * (40 - k)
        assert (resp.num_calls, resp.num_aborts, resp.finish_reason) == (2, 1, "length")
        assert resp.servers == [server.address] * 2


def test_samples_finished_in_the_first_call_are_not_resubmitted(make_server):
    server = make_server()
    responses = run(_samples(InferenceClient([server.address]), ModelRequest(PROMPT, GenerationParams(max_new_tokens=6)), 4))
    assert server.num_requests == 1 and len(server.log) == 4
    assert [r.output_ids for r in responses] == [chain(PROMPT[-1], 6, 1000)] * 4
    assert all(r.num_calls == 1 and r.num_aborts == 0 and r.finish_reason == "length" for r in responses)


def test_samples_one_call_each_where_the_server_takes_one(make_server):
    """A vLLM server is asked one sample per call: n calls, rids `{rid}-{i}`."""
    server = make_server()
    client = InferenceClient([server.address], ClientConfig(server_kind="vllm"))
    req = ModelRequest(PROMPT, GenerationParams(max_new_tokens=5))
    responses = run(_samples(client, req, 3))
    assert server.num_requests == 3 and {e.route for e in server.log} == {"vllm-generate"}
    assert sorted(e.rid for e in server.log) == [f"{req.rid}-{i}" for i in range(3)]
    assert [r.rid for r in responses] == [f"{req.rid}-{i}" for i in range(3)]
    assert all(r.output_ids == chain(PROMPT[-1], 5, 1000) for r in responses)


def test_sample_answers_are_checked():
    adapter = TandemAdapter()
    item = {"output_ids": [], "meta_info": {"finish_reason": {"type": "abort", "message": "x"}}}
    assert [c.finish_reason for c in adapter.parse_samples([{**item, "index": 1}, {**item, "index": 0}], 2)] == \
        ["abort", "abort"]
    with pytest.raises(ValueError, match="list of 3 items, got 2"):
        adapter.parse_samples([{**item, "index": 0}, {**item, "index": 1}], 3)
    with pytest.raises(ValueError, match="list of 2 items, got dict"):
        adapter.parse_samples(item, 2)
    with pytest.raises(ValueError, match=r"'index' fields are \[0, 0\]"):
        adapter.parse_samples([{**item, "index": 0}, {**item, "index": 0}], 2)
    with pytest.raises(UnsupportedOperation, match="one sample per generate call"):
        adapter_for("vllm").generate_body("r", PROMPT, GenerationParams(), 4, n=2)


async def _samples(client: InferenceClient, req: ModelRequest, n: int):
    try:
        return await client.agenerate_samples(req, n)
    finally:
        await client.aclose()


def test_budget_accounting_and_rejection(make_server):
    server = make_server()
    client = InferenceClient([server.address])
    prompt = list(range(1, 11))
    resp = run(generate(client, ModelRequest(prompt, GenerationParams(max_new_tokens=100), max_tokens=16)))
    assert len(resp.output_ids) == 6 and resp.finish_reason == "length"
    assert server.log[-1].input_ids == prompt
    with pytest.raises(PromptTooLongError, match="no budget"):
        run(generate(client, ModelRequest(prompt, GenerationParams(max_new_tokens=100), max_tokens=10)))


def test_final_abort_with_spent_budget_is_length(make_server):
    server = make_server(abort_when_done=True)  # the pause raced the last token
    resp = run(generate(InferenceClient([server.address]), ModelRequest(PROMPT, GenerationParams(max_new_tokens=7))))
    assert resp.finish_reason == "length" and len(resp.output_ids) == 7
    assert resp.num_calls == 1 and resp.num_aborts == 0


def test_abort_while_queued_means_zero_tokens():
    chunk = TandemAdapter().parse_generate(
        {"text": "", "output_ids": [], "meta_info": {"finish_reason": {"type": "abort", "message": "x"}, "weight_version": "3"}}
    )
    assert chunk.output_ids == [] and chunk.finish_reason == "abort" and chunk.weight_version == 3


def test_least_outstanding_routing(make_server):
    a, b = make_server(token_delay_s=0.005), make_server(token_delay_s=0.005)
    client = InferenceClient([a.address, b.address])

    async def scenario():
        try:
            return await asyncio.gather(*(client.agenerate(ModelRequest(PROMPT, GenerationParams(max_new_tokens=20))) for _ in range(6)))
        finally:
            await client.aclose()

    resps = run(scenario())
    assert len(a.log) == 3 and len(b.log) == 3
    assert all(r.output_ids == chain(PROMPT[-1], 20, 1000) for r in resps)
    assert all(s.outstanding == 0 for s in client.pool.snapshot())


def test_pool_affinity_and_health():
    pool = ServerPool(["127.0.0.1:1", "127.0.0.1:2"])
    a, b = pool.addresses
    assert pool.choose("r1") == a
    with pool.lease(a):
        assert pool.choose("r2") == b  # least outstanding
        assert pool.choose("r1") == a  # affinity beats load
    pool.mark_error(a, connection_failed=True)
    assert not pool.is_healthy(a) and pool.choose("r1") == b  # moves off an unhealthy server
    pool.mark_error(b, connection_failed=False)
    assert pool.is_healthy(b)  # one 5xx is not enough
    pool.mark_error(b, connection_failed=True)
    assert pool.choose("r3") in (a, b)  # all unhealthy: still routes
    pool.forget("r1")
    pool.mark_success(a)
    assert pool.choose("r1") == a


def test_pool_abandon_tells_the_calls_in_flight_to_that_server_only():
    pool = ServerPool(["127.0.0.1:1", "127.0.0.1:2"])
    a, b = pool.addresses
    told: list[str] = []
    with pool.lease(a, lambda: told.append("a1")), pool.lease(a, lambda: told.append("a2")), \
            pool.lease(b, lambda: told.append("b")):
        assert pool.abandon("127.0.0.1:1") == 2 and sorted(told) == ["a1", "a2"]
        assert not pool.is_healthy(a) and pool.is_healthy(b)
    assert pool.abandon(b) == 0 and sorted(told) == ["a1", "a2"]  # leases that ended are not told
    assert all(s.outstanding == 0 for s in pool.snapshot())


def test_a_call_abandoned_mid_flight_is_resubmitted_elsewhere(make_server):
    """`ServerPool.abandon` (what an eviction does) ends the call to a server that never answers
    and the request goes on at once on the other server, long before its deadline."""
    hung, good = make_server(hang=True), make_server()
    client = InferenceClient([hung.address, good.address], ClientConfig(backoff_initial_s=0.01, deadline_s=30))
    req = ModelRequest(PROMPT, GenerationParams(max_new_tokens=5))
    assert client.pool.choose(req.rid, exclude=[good.address]) == hung.address

    async def scenario():
        task = asyncio.ensure_future(generate(client, req))
        while client.pool.outstanding(hung.address) == 0:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.1)  # the call is on the wire, waiting for an answer that never comes
        assert client.pool.abandon(hung.address) == 1
        return await task

    start = time.monotonic()
    resp = run(scenario())
    assert time.monotonic() - start < 10
    assert resp.output_ids == chain(PROMPT[-1], 5, 1000) and resp.servers == [good.address]
    assert resp.num_retries == 1 and client.resubmitted_total == 1


def test_500s_are_retried_then_succeed(make_server):
    server = make_server(fail_first=3)
    client = InferenceClient([server.address], ClientConfig(backoff_initial_s=0.01))
    resp = run(generate(client, ModelRequest(PROMPT, GenerationParams(max_new_tokens=5))))
    assert resp.output_ids == chain(PROMPT[-1], 5, 1000)
    assert resp.num_retries == 3 and server.num_requests == 4
    assert client.pool.is_healthy(server.address)


def test_server_that_disappears_hands_requests_to_the_other(spawn_server, make_server):
    """The subprocess server exits mid-request; its requests finish on the other before the deadline."""
    doomed, proc = spawn_server("--token-delay", "0.02", "--die-after", "2", "--die-delay", "0.15")
    survivor = make_server(token_delay_s=0.005)
    client = InferenceClient([doomed, survivor.address], ClientConfig(backoff_initial_s=0.01, deadline_s=15))

    async def scenario():
        try:
            reqs = [ModelRequest(PROMPT, GenerationParams(max_new_tokens=30)) for _ in range(4)]
            return await asyncio.gather(*(client.agenerate(r) for r in reqs))
        finally:
            await client.aclose()

    start = time.monotonic()
    resps = run(scenario())
    assert proc.wait(5) != 0  # it really died
    assert time.monotonic() - start < 15
    moved = [r for r in resps if r.num_retries > 0]
    assert len(moved) == 2  # the two requests that were on the doomed server
    for r in resps:
        assert r.output_ids == chain(PROMPT[-1], 30, 1000) and r.finish_reason == "length"
        assert r.servers == [survivor.address]
    assert not client.pool.is_healthy(doomed)


def test_deadline_exceeded_is_a_typed_error(make_server):
    server = make_server(hang=True)
    client = InferenceClient([server.address])
    req = ModelRequest(PROMPT, GenerationParams(max_new_tokens=5), rid="rid-hung", deadline_s=0.5)
    start = time.monotonic()
    with pytest.raises(GenerationDeadlineError) as info:
        run(generate(client, req))
    assert 0.45 < time.monotonic() - start < 3
    assert info.value.rid == "rid-hung" and info.value.servers == [server.address]
    assert "rid-hung" in str(info.value) and server.address in str(info.value)
    assert isinstance(info.value, TimeoutError)


def test_vllm_backend(make_server):
    server = make_server(token_delay_s=0.0)
    client = InferenceClient([server.address], ClientConfig(server_kind="vllm"))
    client.version.set(7)  # no version set on the server ("default" labels): the client's last known one applies
    resp = run(generate(client, ModelRequest(PROMPT, GenerationParams(max_new_tokens=9))))
    assert server.log[-1].route == "vllm-generate"
    assert resp.output_ids == chain(PROMPT[-1], 9, 1000)
    assert resp.output_logprobs == [token_logprob(t) for t in resp.output_ids]
    assert resp.output_versions == [7] * 9 and resp.finish_reason == "length"

    reporting = make_server(vllm_report_version=True, version=3)
    client = InferenceClient([reporting.address], ClientConfig(server_kind="vllm"))
    resp = run(generate(client, ModelRequest(PROMPT, GenerationParams(max_new_tokens=4))))
    assert resp.output_versions == [3] * 4


@pytest.mark.parametrize("labelled", [True, False], ids=["vllm-labels", "default-labels"])
def test_vllm_interrupted_generation(make_server, labelled):
    """A request paused mid-decode is resubmitted with its partial output, whose tokens keep the
    version that sampled them. `vllm-labels`: the aborted answer reaches the client only after the
    controller announced the next version (a loaded machine lags), and vLLM's per-token labels
    keep the partial at 0; labelled as the answer is read, it would take version 1, which never
    sampled it. `default-labels`: no version was ever set on the server, so the client's version
    stands in, announced here after the resubmission."""
    server = make_server(token_delay_s=0.01, vllm_report_version=labelled, abort_answer_delay_s=0.5 * labelled)
    client = InferenceClient([server.address], ClientConfig(server_kind="vllm"))
    req = ModelRequest(PROMPT, GenerationParams(max_new_tokens=30))

    async def scenario():
        task = asyncio.create_task(client.agenerate(req))
        await asyncio.to_thread(server.wait_for_tokens, 5)
        await asyncio.to_thread(server.pause)
        if labelled:  # the update and set_version, while the aborted answer is on its way
            server.version = 1
            client.version.set(1)
        await asyncio.to_thread(server.wait_for_requests, 2)  # the abort was read, the rest resubmitted
        client.version.set(1)
        server.continue_generation()
        try:
            return await task
        finally:
            await client.aclose()

    resp = run(scenario())
    k = len(server.log[0].output_ids)
    assert 0 < k < 30 and server.log[0].finish == "abort"
    assert resp.output_ids == chain(PROMPT[-1], 30, 1000)
    assert resp.output_versions == [0] * k + [1] * (30 - k) and resp.num_aborts == 1

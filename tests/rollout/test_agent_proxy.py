"""The agent proxy with the real `openai` client: a real `tandem serve` (tiny qwen3) for exact
tokens, logprobs, pauses, retries and weight versions; a fake server scripted to answer with a tool
call for the tool path, where a random model cannot be made to produce one."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from pathlib import Path

import aiohttp
import openai
import pytest
from transformers import AutoTokenizer

from tandem.fleet.generation import GenerationParams
from tandem.rollout.agent.config import AgentConfig
from tandem.rollout.agent.proxy import AgentProxy
from tandem.rollout.chat_tokens import ChatTokens
from tandem.rollout.client import ClientConfig, InferenceClient
from tandem.rollout.version import WeightVersion
from tandem.rollout.workflows.agent import AgentError, AgentWorkflow, load_agent
from tests.inference.conftest import make_model_dir
from tests.inference.server_utils import ServerProcess, wait_for
from tests.rollout.fake_server import FakeServer

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

CALC = {"type": "function", "function": {"name": "calculator", "description": "Evaluate arithmetic.",
                                         "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                                                        "required": ["expression"]}}}


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return make_model_dir(tmp_path_factory.mktemp("agent-model"))


@pytest.fixture(scope="module")
def tokenizer(model):
    return AutoTokenizer.from_pretrained(model)


@pytest.fixture(scope="module")
def server(model, tmp_path_factory):
    proc = ServerProcess(model, tmp_path_factory.mktemp("agent-serve"))
    yield proc
    proc.stop()


def _run(servers: list[str], tokenizer, body, timeout: float = 90.0, version: WeightVersion | None = None):
    """`body(proxy, client)` on a fresh loop with a proxy over `servers`."""

    async def main():
        client = InferenceClient(servers, ClientConfig(deadline_s=60), version=version)
        proxy = AgentProxy(client, tokenizer)
        await proxy.start()
        try:
            return await body(proxy, client)
        finally:
            await proxy.aclose()
            await client.aclose()

    return asyncio.run(asyncio.wait_for(main(), timeout))


def _oai(proxy: AgentProxy, key: str, **kw) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=proxy.base_url, api_key=key, **kw)


GREEDY = GenerationParams(max_new_tokens=6, temperature=0.0)


def test_multi_turn_records_the_exact_tokens_of_the_conversation(server, tokenizer):
    async def body(proxy, client):
        session = proxy.open_session("item", GREEDY)
        oai = _oai(proxy, session.key)
        messages = [{"role": "user", "content": "What is 2 + 3?"}]
        replies = []
        for turn in range(3):
            reply = await oai.chat.completions.create(model="policy", messages=messages, logprobs=True)
            replies.append(reply)
            messages += [reply.choices[0].message.model_dump(exclude_none=True),
                         {"role": "user", "content": f"Why {turn}?"}]
        await oai.close()
        return session, replies, messages[:-1]

    session, replies, _ = _run([server.url], tokenizer, body)
    assert [c.parent for c in session.calls] == [None, session.calls[0], session.calls[1]]
    session.assign_rewards(1.0)
    [traj] = session.export("concat", "g", "p")
    # A random model's tokens are often not what tokenising their text gives back (byte pieces of a
    # character, merges the tokenizer would make differently): each later prompt holds the earlier
    # prompt and output ids exactly as they were, then only the new turn, tokenised.
    for turn, (parent, call) in enumerate(zip(session.calls, session.calls[1:], strict=False)):
        held = parent.prompt_ids + parent.output_ids
        assert call.prompt_ids[: len(held)] == held
        closing = "" if tokenizer.decode(parent.output_ids[-1:]) == "<|im_end|>" else "<|im_end|>"
        assert tokenizer.decode(call.prompt_ids[len(held):]) == (
            f"{closing}\n<|im_start|>user\nWhy {turn}?<|im_end|>\n<|im_start|>assistant\n")
    assert traj.input_ids == session.calls[-1].prompt_ids + session.calls[-1].output_ids
    assert sum(traj.loss_mask) == sum(len(c.output_ids) for c in session.calls)
    # the logprobs are the server's: the answer's, and a direct /generate of the same prompt ids
    for call, reply in zip(session.calls, replies, strict=True):
        assert [t.logprob for t in reply.choices[0].logprobs.content] == call.logprobs
        direct_gen = server.ok("/generate", {"input_ids": call.prompt_ids, "return_logprob": True,
                                             "sampling_params": {"max_new_tokens": 6, "temperature": 0.0}})
        assert direct_gen["output_ids"] == call.output_ids
        assert [lp for lp, _, _ in direct_gen["meta_info"]["output_token_logprobs"]] == pytest.approx(call.logprobs,
                                                                                                        abs=1e-6)
        assert reply.usage.prompt_tokens == len(call.prompt_ids)
        assert reply.model_extra["weight_version"] in (0, "0")
    print(f"agent proxy: 3 chained calls, {len(traj.input_ids)} tokens, {sum(traj.loss_mask)} trained")


def test_tool_calls_and_streaming_through_the_proxy(tokenizer):
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    call_text = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "2 + 3"}}\n</tool_call>'
    replies = [[*tokenizer.encode(call_text), eos], [*tokenizer.encode("The sum is \\boxed{5}"), eos]]
    fake = FakeServer(vocab_size=len(tokenizer), replies=[list(r) for r in replies]).start()
    try:
        async def body(proxy, client):
            session = proxy.open_session("item", GenerationParams(max_new_tokens=256))
            oai = _oai(proxy, session.key)
            messages = [{"role": "user", "content": "What is 2 + 3?"}]
            chunks = [c async for c in await oai.chat.completions.create(
                model="policy", messages=messages, tools=[CALC], stream=True,
                stream_options={"include_usage": True})]
            calls: dict[int, dict] = {}
            finish = None
            for chunk in chunks:
                for choice in chunk.choices:
                    for tc in choice.delta.tool_calls or []:
                        slot = calls.setdefault(tc.index, {"id": "", "name": "", "arguments": ""})
                        slot["id"] += tc.id or ""
                        slot["name"] += (tc.function.name or "") if tc.function else ""
                        slot["arguments"] += (tc.function.arguments or "") if tc.function else ""
                    finish = choice.finish_reason or finish
            assert finish == "tool_calls" and list(calls) == [0], (chunks, [(e.input_ids, e.output_ids) for e in fake.log])
            assert calls[0]["name"] == "calculator" and json.loads(calls[0]["arguments"]) == {"expression": "2 + 3"}
            assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == len(replies[0])
            messages += [{"role": "assistant", "content": None, "tool_calls": [
                {"id": calls[0]["id"], "type": "function",
                 "function": {"name": "calculator", "arguments": calls[0]["arguments"]}}]},
                {"role": "tool", "tool_call_id": calls[0]["id"], "content": "5"}]
            final = await oai.chat.completions.create(model="policy", messages=messages, tools=[CALC])
            assert final.choices[0].message.content == "The sum is \\boxed{5}"
            assert final.choices[0].finish_reason == "stop" and not final.choices[0].message.tool_calls
            await oai.close()
            return session, [*messages, {"role": "assistant", "content": final.choices[0].message.content}]

        session, conversation = _run([fake.address], tokenizer, body)
    finally:
        fake.stop()
    first, second = session.calls
    assert second.parent is first  # the tool call came back as the client sent it: same chain
    assert fake.log[1].input_ids[: len(first.prompt_ids) + len(first.output_ids)] == first.prompt_ids + first.output_ids
    session.assign_rewards(1.0)
    [traj] = session.export("concat", "g", "p")
    # The answers here are canonical tokens (scripted from their text), so the recorded ids are
    # exactly a direct tokenisation of the final conversation, tool call and tool result included
    # (up to the newline the template writes after the last answer): the model's tool call renders
    # back to the text it generated, and the proxy's continuations are the template's own tokens.
    template = ChatTokens(tokenizer, [CALC])
    direct = template.encode(template.render(conversation, add_generation_prompt=False))
    assert traj.input_ids == direct[:-1] and tokenizer.decode(direct[-1:]) == "\n"
    assert traj.loss_mask == [int(i in range(len(first.prompt_ids), len(first.prompt_ids) + len(first.output_ids))
                                  or i >= len(second.prompt_ids)) for i in range(len(traj.input_ids))]


def test_a_call_waits_while_the_server_is_paused_and_an_sdk_retry_replaces_its_attempt(server, tokenizer):
    async def body(proxy, client):
        session = proxy.open_session("item", GREEDY)
        server.ok("/pause_generation", {"mode": "abort"})
        # the SDK gives up on the first attempt after 1 s and retries; the server continues at 2.5 s
        threading.Timer(2.5, lambda: server.ok("/continue_generation", {})).start()
        began = time.monotonic()
        oai = _oai(proxy, session.key, timeout=1.0, max_retries=3)
        reply = await oai.chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"}])
        waited = time.monotonic() - began
        # a request sent again with the retry header (the first attempt's answer was lost)
        headers = {"Authorization": f"Bearer {session.key}", "x-stainless-retry-count": "1"}
        body = {"model": "policy", "messages": [{"role": "user", "content": "hi"}]}
        async with aiohttp.ClientSession() as http, \
                http.post(f"{proxy.base_url}/chat/completions", headers=headers, json=body) as resp:
            again = await resp.json()
        await oai.close()
        return session, reply, again, waited

    session, reply, again, waited = _run([server.url], tokenizer, body)
    assert waited >= 2.0, "the call returned before the server continued"
    # attempts that timed out while generating were cancelled, never recorded; one whose answer
    # was lost (finished as the client gave up) and the answer the raw retry repeats are dropped
    assert [c.id for c in session.live] == [again["id"]]
    assert reply.id in [c.id for c in session.calls]
    assert all(c.dropped == "retried by the client" for c in session.calls[:-1])
    print(f"agent proxy: a call waited {waited:.1f}s for a paused server; {len(session.calls)} recorded, 1 live")


def _generated_tokens(server: ServerProcess) -> int:
    return server.ok("/get_server_info", method="GET", timeout=10)["engine_stats"]["generated_tokens"]


def test_the_version_is_pinned_when_a_call_is_sent(server, tokenizer):
    """The update lands mid-call: observed from the server's token count, not slept into (the tiny
    model decoded all of a 400-token budget within the 0.5 s this test used to sleep)."""
    version = WeightVersion(0)

    async def body(proxy, client):
        session = proxy.open_session("item", GenerationParams(max_new_tokens=3000, temperature=1.0, ignore_eos=True))
        oai = _oai(proxy, session.key)
        before = await asyncio.to_thread(_generated_tokens, server)
        call = asyncio.ensure_future(oai.chat.completions.create(
            model="policy", messages=[{"role": "user", "content": "count"}]))
        await asyncio.to_thread(wait_for, lambda: _generated_tokens(server) > before, 30, 0.01)
        # a weight update as the controller runs it: pause (abort), new version, continue
        await asyncio.to_thread(server.ok, "/pause_generation", {"mode": "abort"})
        version.set(1)
        await asyncio.to_thread(server.ok, "/update_weight_version", {"new_version": "1"})
        await asyncio.to_thread(server.ok, "/continue_generation", {})
        first = await call
        second = await oai.chat.completions.create(model="policy", messages=[{"role": "user", "content": "again"}],
                                                   max_tokens=5)
        await oai.close()
        return session, first, second

    session, first, _ = _run([server.url], tokenizer, body, version=version)
    a, b = session.calls
    assert a.sent_version == 0 and first.model_extra["weight_version"] in (0, "0")
    assert a.versions[0] == 0 and a.versions[-1] == 1 and sorted(a.versions) == a.versions  # split by the update
    assert b.sent_version == 1 and set(b.versions) == {1} and len(b.output_ids) == 5
    print(f"agent proxy: a call sent at v0 produced {a.versions.count(0)} tokens at v0, {a.versions.count(1)} at v1")


def test_the_proxy_refuses_what_it_cannot_honour(server, tokenizer):
    async def body(proxy, client):
        session = proxy.open_session("item", GenerationParams(max_new_tokens=4), max_calls=1)
        oai = _oai(proxy, session.key, max_retries=0)
        msgs = [{"role": "user", "content": "hi"}]
        errors = {}
        for name, kwargs in {"temperature": {"temperature": 0.3}, "n": {"n": 2}, "stop": {"stop": ["x"]}}.items():
            with pytest.raises(openai.BadRequestError) as err:
                await oai.chat.completions.create(model="policy", messages=msgs, **kwargs)
            errors[name] = str(err.value)
        await oai.chat.completions.create(model="policy", messages=msgs, temperature=1.0)  # the run's value is fine
        with pytest.raises(openai.RateLimitError, match="max_calls"):
            await oai.chat.completions.create(model="policy", messages=msgs)
        stranger = _oai(proxy, "wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            await stranger.chat.completions.create(model="policy", messages=msgs)
        await stranger.close()
        await oai.close()
        return errors

    errors = _run([server.url], tokenizer, body)
    assert "gen.temperature" in errors["temperature"], errors
    assert "n must be 1" in errors["n"] and "stop" in errors["stop"], errors


def _workflow(tokenizer, agent: str, n: int = 2, **cfg) -> AgentWorkflow:
    return AgentWorkflow(agent, tokenizer, GenerationParams(max_new_tokens=6), n_samples=n, config=AgentConfig(**cfg))


def _episode(url: str, workflow, item):
    """One episode of `workflow` over the server at `url`, on a fresh loop."""

    async def main():
        client = InferenceClient([url], ClientConfig(deadline_s=60))
        try:
            return await workflow.arun_episode(client, item)
        finally:
            await workflow.aclose_proxy()
            await client.aclose()

    return asyncio.run(asyncio.wait_for(main(), 120))


ITEM = {"id": "q1", "prompt": "2 + 3", "messages": [{"role": "user", "content": "2 + 3"}], "answer": "5",
        "input_ids": [1, 2, 3], "stream_index": 7}


def test_the_agent_workflow_runs_groups_and_reports_agents_that_fail(server, tokenizer):
    trajs = _episode(server.url, _workflow(tokenizer, "tests.rollout.agents:three_turns"), ITEM)
    assert len(trajs) == 2 and len({t.group_id for t in trajs}) == 1 and {t.prompt_id for t in trajs} == {"q1"}
    assert all(t.num_turns == 3 and 0 <= t.reward <= 1 for t in trajs)
    per_call = _workflow(tokenizer, "tests.rollout.agents:per_call", n=1, export="individual", discount=0.0)
    assert sorted(t.reward for t in _episode(server.url, per_call, ITEM)) == [0.25, 0.75]  # two chains, by call id
    discounted = _workflow(tokenizer, "tests.rollout.agents:per_call", n=1, export="individual", discount=0.5)
    assert sorted(t.reward for t in _episode(server.url, discounted, ITEM)) == [0.25 + 0.5 * 0.75, 0.75]
    for agent, message in {"broken": "raised ValueError: no answer for q1", "wordy": "returned str",
                           "sleepy": "ran past rollout.agent.timeout_s=1s"}.items():
        with pytest.raises(AgentError, match=message):
            _episode(server.url, _workflow(tokenizer, f"tests.rollout.agents:{agent}", timeout_s=1.0), ITEM)
    with pytest.raises(AgentError, match="not an async function"):
        load_agent("tests.rollout.agents:not_async")
    with pytest.raises(AgentError, match="cannot be loaded"):
        load_agent("tests.rollout.agents:missing")


def test_an_agents_sdk_agent_trains_through_the_proxy(tokenizer):
    """OpenAI's Agents SDK runs its tool loop against the proxy; its two calls form one chain."""
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    call_text = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "2 + 3"}}\n</tool_call>'
    fake = FakeServer(vocab_size=len(tokenizer), replies=[[*tokenizer.encode(call_text), eos],
                                                          [*tokenizer.encode("\\boxed{5}"), eos]]).start()
    workflow = AgentWorkflow("tests.rollout.agents:sdk_calculator", tokenizer, GenerationParams(max_new_tokens=256),
                             n_samples=1)
    try:
        [traj] = _episode(fake.address, workflow, ITEM)
    finally:
        fake.stop()
    assert traj.reward == 1.0 and traj.num_turns == 2  # the tool ran (2 + 3) and the answer was right
    assert tokenizer.decode(traj.input_ids[traj.loss_mask.index(1):]).startswith("<tool_call>")

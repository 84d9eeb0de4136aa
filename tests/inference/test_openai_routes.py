"""`tandem serve`'s /v1 routes through the real openai client: streams that add up to the plain
answers (text, logprobs, usage), real top logprobs, tools through the chat template, the
weight_version extension, refusals, and disconnects. The tiny model's answers are random text, so
tool calls in answers are tested on the protocol pieces (tests/openai_compat)."""

from __future__ import annotations

import math
import shutil

import pytest
import transformers

from tests.inference.server_utils import ServerProcess
from tests.inference.test_server_routes import open_request, wait_idle, wait_running
from tests.openai_compat.tool_template import TOOL_CHAT_TEMPLATE

openai = pytest.importorskip("openai")

MESSAGES = [{"role": "system", "content": "You answer briefly."}, {"role": "user", "content": "What is 2 + 3?"}]
TOOL = {"type": "function", "function": {"name": "add", "description": "Add two integers",
                                         "parameters": {"type": "object", "properties": {"a": {"type": "integer"},
                                                                                         "b": {"type": "integer"}}}}}
GREEDY = {"temperature": 0.0, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def tools_model_dir(qwen3_dir, tmp_path_factory):
    """The tiny qwen3 model with a Qwen-style tool-aware chat template."""
    root = tmp_path_factory.mktemp("tools-model") / "qwen3-tools"
    shutil.copytree(qwen3_dir, root)
    tok = transformers.AutoTokenizer.from_pretrained(root)
    tok.chat_template = TOOL_CHAT_TEMPLATE
    tok.save_pretrained(root)
    return root


@pytest.fixture(scope="module")
def server(tools_model_dir, tmp_path_factory):
    srv = ServerProcess(tools_model_dir, tmp_path_factory.mktemp("serve"), "--max-num-seqs", "8",
                        "--kv-cache-tokens", "8192", "--block-size", "8")
    yield srv
    assert srv.stop() == 0, srv.log.read_text()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=60, max_retries=0)


@pytest.fixture(scope="module")
def tokenizer(tools_model_dir):
    return transformers.AutoTokenizer.from_pretrained(tools_model_dir)


def uncached(server, call):
    """`call()` after dropping the prefix cache: a cache hit computes the prompt in other chunks,
    which moves float32 logprobs by an ulp; without one, equal requests give equal bits."""
    server.ok("/flush_cache")
    return call()


def stream_snapshot(client, **kw):
    """The message the SDK's `chat.completions.stream` helper assembles from the chunks (its
    `get_final_completion` refuses finish_reason "length", which these random models hit)."""
    with client.chat.completions.stream(**kw) as stream:
        stream.until_done()
        return stream.current_completion_snapshot


def prompt_len(tokenizer, messages, tools=None) -> int:
    text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


def streamed_logprobs(chunks, index=0):
    return [e for c in chunks for ch in c.choices if ch.index == index and ch.logprobs for e in ch.logprobs.content]


def check_top_logprobs(entries, k, greedy):
    for e in entries:
        tops = e.top_logprobs
        assert len(tops) == k and [t.logprob for t in tops] == sorted((t.logprob for t in tops), reverse=True)
        if greedy:  # the sampled token is the most likely one
            assert tops[0].token == e.token and math.isclose(tops[0].logprob, e.logprob, abs_tol=1e-6)
        assert len({t.token for t in tops}) == k  # pieces of characters too: shown as "bytes:\x.."
        same = [t for t in tops if t.token == e.token]
        if same:  # among the alternatives: the same logprob there
            assert math.isclose(same[0].logprob, e.logprob, abs_tol=1e-6)
        assert e.logprob <= tops[0].logprob + 1e-6


# ------------------------------------------------------------------------------ chat
def test_streamed_chat_adds_up_to_the_answer(server, client, tokenizer):
    kw = {"model": "tiny", "messages": MESSAGES, "max_tokens": 12, "logprobs": True, "top_logprobs": 3, **GREEDY}
    whole = uncached(server, lambda: client.chat.completions.create(**kw))
    chunks = uncached(server, lambda: list(client.chat.completions.create(
        stream=True, stream_options={"include_usage": True}, **kw)))
    choice = whole.choices[0]
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == choice.message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [(e.token, e.logprob) for e in streamed_logprobs(chunks)] == \
        [(e.token, e.logprob) for e in choice.logprobs.content]
    assert len(choice.logprobs.content) == 12 and whole.usage.completion_tokens == 12
    check_top_logprobs(choice.logprobs.content, 3, greedy=True)
    check_top_logprobs(streamed_logprobs(chunks), 3, greedy=True)
    assert whole.usage.prompt_tokens == prompt_len(tokenizer, MESSAGES)
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert [c.choices[0].finish_reason for c in finals] == ["length"] == [choice.finish_reason]
    assert whole.model_extra["weight_version"] == "0" and all(c.model_extra["weight_version"] == "0" for c in chunks)


def test_seeded_samples_stream_like_the_answer(server, client):
    kw = {"model": "tiny", "messages": MESSAGES, "max_tokens": 10, "n": 2, "seed": 7, "temperature": 1.0,
          "logprobs": True, "top_logprobs": 2, "extra_body": {"ignore_eos": True}}
    whole = uncached(server, lambda: client.chat.completions.create(**kw))
    final = uncached(server, lambda: stream_snapshot(client, **kw))
    assert [c.index for c in final.choices] == [0, 1]
    for got, want in zip(final.choices, whole.choices, strict=True):
        assert got.message.content == want.message.content and got.finish_reason == want.finish_reason
        assert [(e.token, e.logprob) for e in got.logprobs.content] == \
            [(e.token, e.logprob) for e in want.logprobs.content]
        check_top_logprobs(want.logprobs.content, 2, greedy=False)
    assert whole.choices[0].message.content != whole.choices[1].message.content


def test_tools_go_through_the_template_and_streams_parse_like_answers(client, tokenizer):
    plain = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2, **GREEDY)
    kw = {"model": "tiny", "messages": MESSAGES, "tools": [TOOL], "max_tokens": 16, **GREEDY}
    whole = client.chat.completions.create(**kw)
    assert whole.usage.prompt_tokens == prompt_len(tokenizer, MESSAGES, [TOOL]) > plain.usage.prompt_tokens
    none = client.chat.completions.create(tool_choice="none", **{**kw, "max_tokens": 2})
    assert none.usage.prompt_tokens == plain.usage.prompt_tokens  # tool_choice "none": the tools stay out
    chunks = list(client.chat.completions.create(stream=True, **kw))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    assert [c.choices[0].finish_reason for c in chunks].count(None) == len(chunks) - 1
    final = stream_snapshot(client, **kw).choices[0]
    want = whole.choices[0]
    assert final.message.content == want.message.content and final.finish_reason == want.finish_reason
    assert [(c.function.name, c.function.arguments) for c in final.message.tool_calls or []] == \
        [(c.function.name, c.function.arguments) for c in want.message.tool_calls or []]
    history = [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "5"}]
    follow = client.chat.completions.create(model="tiny", messages=history, tools=[TOOL], max_tokens=2, **GREEDY)
    assert follow.usage.prompt_tokens == prompt_len(tokenizer, [{**m, "tool_calls": [
        {**c, "function": {"name": "add", "arguments": {"a": 2, "b": 3}}} for c in m["tool_calls"]]}
        if "tool_calls" in m else m for m in history], [TOOL])


@pytest.mark.parametrize("kw, needle", [
    ({"response_format": {"type": "json_object"}}, "'response_format' of type 'json_object' is not supported"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}},
     "'response_format' of type 'json_schema'"),
    ({"tools": [TOOL], "tool_choice": "required"}, "'tool_choice' = 'required' is not supported"),
    ({"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "add"}}}, "a named function"),
    ({"extra_body": {"colour": "red"}}, "unknown field(s) ['colour']"),
    ({"logprobs": False, "top_logprobs": 2}, "'top_logprobs' needs 'logprobs': true"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
      "max_tokens": 1}, "'image_url' parts are not supported"),
    ({"seed": 10**23}, "sampling_params.seed must be an integer"),
])
def test_refusals_are_400s_naming_the_field(client, kw, needle):
    kw = {"model": "tiny", "messages": MESSAGES, "max_tokens": 2, **kw}
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(**kw)
    assert needle in err.value.body["message"], err.value.body
    with pytest.raises(openai.BadRequestError):
        list(client.chat.completions.create(stream=True, **kw))


def test_a_client_that_leaves_a_stream_aborts_it(server):
    body = {"messages": MESSAGES, "max_tokens": 3000, "stream": True, "ignore_eos": True}
    sock = open_request(server, body, "/v1/chat/completions")
    wait_running(server)
    assert sock.recv(64).startswith(b"HTTP/1.1 200")
    sock.close()
    stats = wait_idle(server)
    assert stats["free_blocks"] == stats["num_blocks"]


# ------------------------------------------------------------------------------ completions
def test_streamed_completions_add_up_to_the_answer(server, client):
    kw = {"model": "tiny", "prompt": [[11, 12, 13], [14, 15]], "max_tokens": 8, "n": 2, "seed": 3,
          "temperature": 1.0, "logprobs": 2, "extra_body": {"ignore_eos": True}}
    whole = uncached(server, lambda: client.completions.create(**kw))
    chunks = uncached(server, lambda: list(client.completions.create(
        stream=True, stream_options={"include_usage": True}, **kw)))
    assert sorted(c.index for c in whole.choices) == [0, 1, 2, 3] and whole.usage.prompt_tokens == 5
    for want in whole.choices:
        mine = [ch for c in chunks for ch in c.choices if ch.index == want.index]
        assert "".join(ch.text for ch in mine) == want.text
        got = {key: [x for ch in mine if ch.logprobs for x in getattr(ch.logprobs, key)]
               for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}
        assert got["tokens"] == want.logprobs.tokens and got["text_offset"] == want.logprobs.text_offset
        # two prompts prefill together or one after the other: float32 logprobs may move by an ulp
        assert got["token_logprobs"] == pytest.approx(want.logprobs.token_logprobs, abs=1e-5)
        assert [sorted(t) for t in got["top_logprobs"]] == [sorted(t) for t in want.logprobs.top_logprobs]
        assert mine[-1].finish_reason == want.finish_reason == "length"
        for top, token, lp in zip(want.logprobs.top_logprobs, want.logprobs.tokens, want.logprobs.token_logprobs,
                                  strict=True):
            assert 2 <= len(top) <= 3 and math.isclose(top[token], lp, abs_tol=1e-6)
    assert chunks[-1].usage == whole.usage and whole.model_extra["weight_version"] == "0"


def test_streams_hold_back_stop_strings(client):
    kw = {"model": "tiny", "prompt": [20, 21, 22], "max_tokens": 24, **GREEDY}
    base = client.completions.create(**kw).choices[0].text
    middle = base[len(base) // 2:]
    stop = next(middle[i:i + 2] for i in range(len(middle) - 1) if "\ufffd" not in middle[i:i + 2])
    whole = client.completions.create(stop=[stop], **kw).choices[0]
    assert whole.text == base[:base.find(stop)] and whole.finish_reason == "stop"
    chunks = list(client.completions.create(stop=[stop], stream=True, **kw))
    assert "".join(ch.text for c in chunks for ch in c.choices) == whole.text
    chat = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=24, **GREEDY)
    text = chat.choices[0].message.content
    stop = next(text[i:i + 2] for i in range(len(text) // 2, len(text) - 1) if "\ufffd" not in text[i:i + 2])
    kw = {"model": "tiny", "messages": MESSAGES, "max_tokens": 24, "stop": stop, **GREEDY}
    want = client.chat.completions.create(**kw).choices[0].message.content
    assert stream_snapshot(client, **kw).choices[0].message.content == want == text[:text.find(stop)]

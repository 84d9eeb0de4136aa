"""Chat protocol pieces against a real tokenizer: templates with tools, tool-call parsing, the
answer and the stream, each checked by the openai SDK's own models and stream accumulator."""

from __future__ import annotations

import json

import pytest

from tandem.openai_compat import (
    ChatStream,
    ChoiceOutput,
    OpenAIRequestError,
    chat_completion,
    parse_chat_request,
    parse_tool_calls,
    render_chat,
    sse,
)
from tandem.openai_compat.stream import SSE_DONE
from tests.openai_compat.test_request import TOOL

openai = pytest.importorskip("openai")
from openai.lib.streaming.chat import ChatCompletionStreamState  # noqa: E402
from openai.types.chat import ChatCompletion, ChatCompletionChunk  # noqa: E402

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
CALL2 = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET", "exact": true}}\n</tool_call>'


# ------------------------------------------------------------------------------ templates
def test_render_chat_puts_tools_and_calls_through_the_template(tokenizer):
    req = parse_chat_request({"messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"}], "tools": [TOOL]})
    text = render_chat(tokenizer, req.messages, req.template_tools)
    assert json.dumps(TOOL) in text and "<tools>" in text
    # arguments reach the template as an object (HF's convention), not as a JSON string
    assert '{"name": "get_weather", "arguments": {"city": "Paris"}}' in text
    assert "<tool_response>\nsunny\n</tool_response>" in text and text.endswith("<|im_start|>assistant\n")
    plain = render_chat(tokenizer, req.messages)
    assert "<tools>" not in plain and len(tokenizer(plain)["input_ids"]) < len(tokenizer(text)["input_ids"])
    assert not render_chat(tokenizer, req.messages, add_generation_prompt=False).endswith("assistant\n")


def test_render_chat_errors_name_the_messages(tokenizer):
    class NoTemplate:
        chat_template = None

    with pytest.raises(OpenAIRequestError, match="has no chat template") as err:
        render_chat(NoTemplate(), [{"role": "user", "content": "x"}])
    assert err.value.field == "messages"
    original = tokenizer.chat_template
    tokenizer.chat_template = "{{ raise_exception('only user turns, please') }}"
    try:
        with pytest.raises(OpenAIRequestError, match=r"cannot render these messages.*only user turns") as err:
            render_chat(tokenizer, [{"role": "user", "content": "x"}])
    finally:
        tokenizer.chat_template = original
    assert err.value.field == "messages"


# ------------------------------------------------------------------------------ tool-call parsing
def test_parse_several_calls_with_text_around_them():
    content, calls = parse_tool_calls(f"Let me check.\n{CALL}\n{CALL2}\n")
    assert content == "Let me check."
    assert [(c["type"], c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("function", "get_weather", {"city": "Paris"}), ("function", "get_time", {"zone": "CET", "exact": True})]
    assert all(c["id"].startswith("call_") for c in calls) and calls[0]["id"] != calls[1]["id"]
    content, calls = parse_tool_calls(f"\n{CALL}{CALL2}\n")
    assert content is None and [c["function"]["name"] for c in calls] == ["get_weather", "get_time"]


@pytest.mark.parametrize("block", [
    "<tool_call>\n{not json}\n</tool_call>",
    '<tool_call>\n{"arguments": {"a": 1}}\n</tool_call>',  # no name
    '<tool_call>\n["get_weather"]\n</tool_call>',
    '<tool_call>\n{"name": "f", "arguments": [1]}\n</tool_call>',
])
def test_a_block_that_is_not_a_call_stays_text(block):
    content, calls = parse_tool_calls(f"A {block} B {CALL}")
    assert content == f"A {block} B" and [c["function"]["name"] for c in calls] == ["get_weather"]


def test_an_unclosed_trailing_call_stays_text():
    text = f'{CALL}\nthen <tool_call>\n{{"name": "get_time", "argum'
    content, calls = parse_tool_calls(text)
    assert content == 'then <tool_call>\n{"name": "get_time", "argum' and len(calls) == 1


def test_string_arguments_and_no_calls():
    _, calls = parse_tool_calls('<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>')
    assert json.loads(calls[0]["function"]["arguments"]) == {"a": 1}
    assert parse_tool_calls("  just text \n") == ("just text", [])
    assert parse_tool_calls("") == (None, [])


# ------------------------------------------------------------------------------ answers
def choice(tokenizer, text, index=0, finish="stop", top=None, logprobs=True):
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    lps = [-0.1 * (i + 1) for i in range(len(ids))] if logprobs else None
    tops = [[(-0.05, t), (-3.0, t + 1), (-4.0, t + 2)][:top] for t in ids] if top else None
    return ChoiceOutput(index=index, output_ids=ids, text=text, logprobs=lps, top_logprobs=tops, finish_reason=finish,
                        matched_stop=None, weight_version="3")


def test_chat_completion_with_tool_calls_validates_as_the_sdk_model(tokenizer, token_text):
    body = chat_completion(id="chatcmpl-1", model="m", created=1, choices=[
        choice(tokenizer, f"Checking.\n{CALL}", top=2), choice(tokenizer, "No tools needed.", index=1, top=2)],
        prompt_tokens=11, token_text=token_text, parse_tools=True, weight_version="3", top_logprobs=2)
    parsed = ChatCompletion.model_validate(body)
    first, second = parsed.choices
    assert first.finish_reason == "tool_calls" and first.message.content == "Checking."
    call = first.message.tool_calls[0]
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    assert second.finish_reason == "stop" and second.message.tool_calls is None
    assert second.message.content == "No tools needed."
    n_tokens = len(tokenizer(f"Checking.\n{CALL}")["input_ids"])
    assert len(first.logprobs.content) == n_tokens and all(len(e.top_logprobs) == 2 for e in first.logprobs.content)
    entry = first.logprobs.content[0]
    assert entry.token == token_text(choice(tokenizer, "Checking.").output_ids[0]) and entry.logprob == -0.1
    assert entry.bytes == list(entry.token.encode()) and entry.top_logprobs[0].logprob == -0.05
    assert parsed.usage.prompt_tokens == 11 and parsed.usage.total_tokens == 11 + parsed.usage.completion_tokens
    assert body["weight_version"] == "3" and body["choices"][0]["weight_version"] == "3"


def test_without_tool_parsing_the_text_is_the_content(tokenizer, token_text):
    body = chat_completion(id="c", model="m", created=1, choices=[choice(tokenizer, f" {CALL} ", logprobs=False)],
                           prompt_tokens=1, token_text=token_text, parse_tools=False, weight_version=None,
                           top_logprobs=0)
    parsed = ChatCompletion.model_validate(body)
    assert parsed.choices[0].message.content == f" {CALL} " and parsed.choices[0].logprobs is None
    assert "weight_version" not in body


def test_a_call_cut_by_the_budget_keeps_finish_reason_length(tokenizer, token_text):
    body = chat_completion(id="c", model="m", created=1, choices=[choice(tokenizer, f"{CALL} and", finish="length")],
                           prompt_tokens=1, token_text=token_text, parse_tools=True, weight_version=0, top_logprobs=0)
    assert body["choices"][0]["finish_reason"] == "length" and len(body["choices"][0]["message"]["tool_calls"]) == 1


# ------------------------------------------------------------------------------ streams
def stream_choice(stream, tokenizer, out: ChoiceOutput, decode_final=None):
    """Feed `out` token by token, as a server does; -> the chunks."""
    chunks = []
    for i, t in enumerate(out.output_ids):
        chunks += stream.delta(out.index, [t], None if out.logprobs is None else [out.logprobs[i]],
                               None if out.top_logprobs is None else [out.top_logprobs[i]],
                               tokenizer.decode(out.output_ids[:i + 1]))
    return chunks + stream.finish(out)


def accumulate(chunks, tools=None):
    state = ChatCompletionStreamState(input_tools=tools) if tools else ChatCompletionStreamState()
    for c in chunks:
        state.handle_chunk(ChatCompletionChunk.model_validate(c))
    return state.get_final_completion()


@pytest.mark.parametrize("text", [f"I'll check the weather.\n\n{CALL}\n{CALL2}", f"{CALL}", f"A {CALL} B",
                                  "<tool_call> not json </tool_call> ok", "Plain answer <tool mentions"])
def test_stream_with_tools_assembles_to_the_non_streamed_message(tokenizer, token_text, text):
    out = choice(tokenizer, text, top=3)
    chunks = stream_choice(ChatStream("c", "m", 1, True, token_text, 3, False, "3"), tokenizer, out)
    streamed = accumulate(chunks, [TOOL]).choices[0]
    whole = ChatCompletion.model_validate(chat_completion(
        id="c", model="m", created=1, choices=[out], prompt_tokens=1, token_text=token_text, parse_tools=True,
        weight_version="3", top_logprobs=3)).choices[0]
    assert streamed.message.content == whole.message.content
    assert [(c.function.name, c.function.arguments) for c in streamed.message.tool_calls or []] == \
        [(c.function.name, c.function.arguments) for c in whole.message.tool_calls or []]
    assert streamed.finish_reason == whole.finish_reason
    assert [e.model_dump() for e in streamed.logprobs.content] == [e.model_dump() for e in whole.logprobs.content]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    if "<tool" not in (whole.message.content or ""):  # held back, never sent as content
        assert all("<tool" not in (c["choices"][0]["delta"].get("content") or "") for c in chunks)


def test_tool_call_chunks_have_the_openai_shape(tokenizer, token_text):
    out = choice(tokenizer, f"{CALL}\n{CALL2}", logprobs=False)
    chunks = stream_choice(ChatStream("c", "m", 1, True, token_text, 0, True, "3"), tokenizer, out)
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert deltas[0] == {"role": "assistant"}  # no text yet, so no content (null when only calls)
    calls = [d["tool_calls"][0] for d in deltas if "tool_calls" in d]
    assert [(c["index"], c["type"], c["function"]["name"]) for c in calls] == [
        (0, "function", "get_weather"), (1, "function", "get_time")]
    assert all(set(c) == {"index", "id", "type", "function"} for c in calls)
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls" and deltas[-1] == {}
    assert accumulate(chunks).choices[0].message.content is None


def test_stream_text_never_splits_a_character_and_holds_back_stop_strings(tokenizer, token_text):
    text = "naïve 日本語 café, then STOP"
    out = choice(tokenizer, text)
    final = ChoiceOutput(out.index, out.output_ids, "naïve 日本語 café, then", out.logprobs, None, "stop", " STOP")
    stream = ChatStream("c", "m", 1, False, token_text, 0, False, None, stop=[" STOP"])
    chunks = [c for i, t in enumerate(out.output_ids)
              for c in stream.delta(0, [t], [out.logprobs[i]], None, tokenizer.decode(out.output_ids[:i + 1]))]
    pieces = [c["choices"][0]["delta"].get("content", "") for c in chunks]
    assert all("\ufffd" not in p for p in pieces) and "".join(pieces) == "naïve 日本語 café, then"
    chunks += stream.finish(final)
    assert accumulate(chunks).choices[0].message.content == final.text
    assert len(accumulate(chunks).choices[0].logprobs.content) == len(out.output_ids)
    assert chunks[-1]["choices"][0]["matched_stop"] == " STOP" and "weight_version" not in chunks[-1]


def test_n_choices_and_usage_chunk(tokenizer, token_text):
    stream = ChatStream("c", "m", 7, False, token_text, 0, True, "1")
    outs = [choice(tokenizer, "first answer", 0, logprobs=False), choice(tokenizer, "second one", 1, logprobs=False)]
    chunks = stream.delta(0, [], None, None, "") + stream.delta(1, [], None, None, "")
    for i in range(max(len(o.output_ids) for o in outs)):  # interleaved, as the engine steps them
        for o in outs:
            if i < len(o.output_ids):
                chunks += stream.delta(o.index, [o.output_ids[i]], None, None, tokenizer.decode(o.output_ids[:i + 1]))
    chunks += stream.finish(outs[1]) + stream.finish(outs[0])
    final = accumulate(chunks)
    assert [c.message.content for c in final.choices] == ["first answer", "second one"]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    # the version of the weights that made each choice, once it is known
    assert [c["weight_version"] for c in chunks] == ["1"] * (len(chunks) - 2) + ["3", "3"]
    last = stream.usage_chunk(5, 4)
    assert last["choices"] == [] and ChatCompletionChunk.model_validate(last).usage.total_tokens == 9
    assert ChatStream("c", "m", 7, False, token_text, 0, False, "1").usage_chunk(5, 4) is None


def test_sse_framing():
    assert sse({"a": "é"}) == 'data: {"a": "é"}\n\n' and sse("[DONE]") == SSE_DONE == "data: [DONE]\n\n"

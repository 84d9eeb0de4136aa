"""Parsing OpenAI request bodies: normalised messages, tools, sampling names, and every refusal
naming its field and the fix."""

from __future__ import annotations

import pytest

from tandem.errors import TandemError
from tandem.openai_compat import OpenAIRequestError, parse_chat_request, parse_completion_request

USER = [{"role": "user", "content": "hi"}]
TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                         "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}


def refused(parse, body, field, *needles):
    with pytest.raises(OpenAIRequestError) as err:
        parse(body)
    assert err.value.field == field, (err.value.field, str(err.value))
    for needle in needles:
        assert needle in str(err.value), str(err.value)
    return err.value


def test_minimal_chat_request_and_defaults():
    req = parse_chat_request({"model": "m", "messages": USER})
    assert req.model == "m" and req.messages == USER and req.tools is None and req.tool_choice == "none"
    assert req.sampling == {} and not req.stream and not req.include_usage and not req.logprobs
    assert req.top_logprobs == 0 and req.extra == {} and not req.parse_tools and req.template_tools is None


def test_sampling_fields_get_sglang_names_only_when_given():
    req = parse_chat_request({"messages": USER, "max_completion_tokens": 7, "temperature": 0, "top_p": 0.5,
                              "top_k": 5, "min_p": 0.1, "n": 2, "stop": ["\n"], "stop_token_ids": [3], "seed": 1,
                              "frequency_penalty": 0.1, "presence_penalty": 0.2, "ignore_eos": True, "min_tokens": 1,
                              "skip_special_tokens": False, "repetition_penalty": 1.1, "top_logprobs": None})
    assert req.sampling == {"max_new_tokens": 7, "temperature": 0, "top_p": 0.5, "top_k": 5, "min_p": 0.1, "n": 2,
                            "stop": ["\n"], "stop_token_ids": [3], "seed": 1, "frequency_penalty": 0.1,
                            "presence_penalty": 0.2, "ignore_eos": True, "min_new_tokens": 1,
                            "skip_special_tokens": False, "repetition_penalty": 1.1}
    assert parse_chat_request({"messages": USER, "max_tokens": 4}).sampling == {"max_new_tokens": 4}
    assert parse_chat_request({"messages": USER, "max_tokens": 4, "max_completion_tokens": 4}).sampling == {
        "max_new_tokens": 4}
    refused(parse_chat_request, {"messages": USER, "max_tokens": 4, "max_completion_tokens": 5},
            "max_completion_tokens", "differ")
    refused(parse_chat_request, {"messages": USER, "temperature": "hot"}, "temperature", "must be a number")
    refused(parse_chat_request, {"messages": USER, "n": True}, "n", "must be an integer")
    refused(parse_chat_request, {"messages": USER, "stop": [1]}, "stop", "a string or a list of strings")


def test_messages_are_normalised():
    body = {"messages": [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}], "name": "ann"},
        {"role": "assistant", "content": None, "refusal": None, "annotations": [], "audio": None,
         "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{\"x\": 1}"}},
                        {"id": "c2", "function": {"name": "g", "arguments": {"y": "é"}}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "2"},
    ]}
    assert parse_chat_request(body).messages == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "a\nb", "name": "ann"},
        {"role": "assistant", "content": None,
         "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{\"x\": 1}"}},
                        {"id": "c2", "type": "function", "function": {"name": "g", "arguments": "{\"y\": \"é\"}"}}]},
        {"role": "tool", "content": "2", "tool_call_id": "c1"},
    ]


@pytest.mark.parametrize("messages, field, needle", [
    ([], "messages", "non-empty list"),
    (["hi"], "messages[0]", "must be an object"),
    ([{"role": "robot", "content": "x"}], "messages[0].role", "must be one of"),
    ([{"role": "user"}], "messages[0].content", "required for a user message"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], "messages[0].content[0]",
     "'image_url' parts are not supported"),
    ([{"role": "user", "content": "x", "colour": 1}], "messages[0].colour", "unknown field"),
    ([{"role": "assistant", "content": "x", "refusal": "no"}], "messages[0].refusal", "unknown field"),
    ([{"role": "user", "content": "x", "tool_calls": [{}]}], "messages[0].tool_calls", "only valid in an assistant"),
    ([{"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f",
                                                                                        "arguments": "{x"}}]}],
     "messages[0].tool_calls[0].function.arguments", "not valid JSON"),
    ([{"role": "assistant", "tool_calls": [{"id": "c", "function": {"arguments": "{}"}}]}],
     "messages[0].tool_calls[0].function", "\"name\""),
    ([{"role": "assistant", "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": "[1]"}}]}],
     "messages[0].tool_calls[0].function.arguments", "JSON object"),
])
def test_bad_messages_name_the_field(messages, field, needle):
    refused(parse_chat_request, {"messages": messages}, field, needle)


def test_tools_and_tool_choice():
    req = parse_chat_request({"messages": USER, "tools": [TOOL]})
    assert req.tools == [TOOL] and req.tool_choice == "auto" and req.parse_tools and req.template_tools == [TOOL]
    none = parse_chat_request({"messages": USER, "tools": [TOOL], "tool_choice": "none"})
    assert none.tool_choice == "none" and not none.parse_tools and none.template_tools is None
    assert parse_chat_request({"messages": USER, "tools": [], "tool_choice": "auto"}).tools is None
    assert parse_chat_request({"messages": USER, "tool_choice": "auto"}).tool_choice == "none"
    err = refused(parse_chat_request, {"messages": USER, "tools": [TOOL], "tool_choice": "required"}, "tool_choice",
                  "'required' is not supported", "constrained decoding", "\"auto\"")
    assert err.status == 400
    refused(parse_chat_request, {"messages": USER, "tools": [TOOL],
                                 "tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
            "tool_choice", "a named function is not supported")
    refused(parse_chat_request, {"messages": USER, "tool_choice": "sometimes"}, "tool_choice", "\"auto\" or \"none\"")
    refused(parse_chat_request, {"messages": USER, "tools": [{"type": "web_search"}]}, "tools[0]",
            "only function tools")
    refused(parse_chat_request, {"messages": USER, "tools": [{"type": "function", "function": {"name": ""}}]},
            "tools[0].function.name", "non-empty string")
    refused(parse_chat_request, {"messages": USER, "tools": [{"type": "function", "function": {"name": "f",
                                                                                               "params": {}}}]},
            "tools[0].function.params", "unknown field")


@pytest.mark.parametrize("kind", ["json_object", "json_schema"])
def test_json_response_formats_are_refused(kind):
    refused(parse_chat_request, {"messages": USER, "response_format": {"type": kind}}, "response_format",
            f"'response_format' of type '{kind}' is not supported", "constrained decoding")


def test_text_response_format_and_harmless_fields_are_accepted():
    body = {"messages": USER, "response_format": {"type": "text"}, "parallel_tool_calls": False,
            "metadata": {"a": "b"}, "store": False, "service_tier": "auto", "user": "u", "logit_bias": {},
            "modalities": ["text"], "stream": True, "stream_options": {"include_usage": True}}
    req = parse_chat_request(body)
    assert req.extra == {"parallel_tool_calls": False, "metadata": {"a": "b"}, "store": False, "service_tier": "auto"}
    assert req.user == "u" and req.stream and req.include_usage
    assert not parse_chat_request({"messages": USER, "stream_options": {"include_usage": True}}).include_usage


@pytest.mark.parametrize("extra, field, needle", [
    ({"colour": 1}, "colour", "unknown field(s) ['colour']"),
    ({"logit_bias": {"5": 10}}, "logit_bias", "not supported"),
    ({"functions": [{"name": "f"}]}, "functions", "send 'tools'"),
    ({"modalities": ["text", "audio"]}, "modalities", "text-only"),
    ({"response_format": {"type": "xml"}}, "response_format", "must be {\"type\": \"text\"}"),
    ({"top_logprobs": 2}, "top_logprobs", "needs 'logprobs': true"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs", "[0, 20]"),
    ({"logprobs": 1}, "logprobs", "true or false"),
    ({"stream": True, "stream_options": {"include_usage": True, "x": 1}}, "stream_options.x", "unknown field"),
    ({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs", "may not set ['tools']"),
])
def test_chat_refusals_name_the_field(extra, field, needle):
    refused(parse_chat_request, {"messages": USER, **extra}, field, needle)


def test_error_type():
    err = refused(parse_chat_request, {"messages": USER, "colour": 1}, "colour")
    assert isinstance(err, ValueError) and isinstance(err, TandemError) and err.status == 400
    refused(parse_chat_request, [1], None, "must be a JSON object")


def test_completion_requests():
    req = parse_completion_request({"model": "m", "prompt": "the cat", "max_tokens": 3, "logprobs": 2,
                                    "echo": False, "best_of": 1, "suffix": None, "stream": True,
                                    "stream_options": {"include_usage": True}})
    assert req.prompts == ["the cat"] and req.sampling == {"max_new_tokens": 3} and req.logprobs == 2
    assert req.stream and req.include_usage
    assert parse_completion_request({"prompt": [1, 2]}).prompts == [[1, 2]]
    assert parse_completion_request({"prompt": [[1, 2], "x"]}).prompts == [[1, 2], "x"]
    assert parse_completion_request({"prompt": "x"}).logprobs is None


@pytest.mark.parametrize("extra, field, needle", [
    ({"prompt": None}, "prompt", "'prompt' is required"),
    ({"prompt": []}, "prompt", "a non-empty list of token ids"),
    ({"prompt": [1, -2]}, "prompt", "integers >= 0"),
    ({"echo": True}, "echo", "not supported"),
    ({"suffix": "end"}, "suffix", "not supported"),
    ({"best_of": "x"}, "best_of", "'best_of' must be an integer"),
    ({"best_of": 3}, "best_of", "send n"),
    ({"logprobs": 21}, "logprobs", "[0, 20]"),
    ({"messages": USER}, "messages", "unknown field"),
])
def test_completion_refusals_name_the_field(extra, field, needle):
    refused(parse_completion_request, {"prompt": "x", **extra}, field, needle)

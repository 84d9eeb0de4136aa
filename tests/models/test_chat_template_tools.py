"""The tiny tokenizer's chat template with tools: Qwen's tool-call format, plain ChatML unchanged
without tools, and a model-written tool call that renders back to the same text."""

from __future__ import annotations

import json
import re

import pytest
from transformers import AutoTokenizer

from tandem.models.tiny import build_tokenizer, save_tokenizer

# The template before tools were added, kept here to prove that plain conversations are unchanged.
PLAIN_CHATML = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)
PLAIN_CONVERSATIONS = [
    [{"role": "user", "content": "What is 2 + 3?"}],
    [{"role": "system", "content": "You are a careful math tutor."}, {"role": "user", "content": "What is 2 + 3?"}],
    [{"role": "user", "content": "What is 3 + 5 + 8?"}, {"role": "assistant", "content": "\\boxed{16}"}],
    [
        {"role": "system", "content": "  spaces \n and newlines\n\n"},
        {"role": "user", "content": "first {{ not jinja }} {% raw %}"},
        {"role": "assistant", "content": "<think>\nhm\n</think>\n\\boxed{1}"},
        {"role": "user", "content": "Wrong, try again."},
        {"role": "assistant", "content": ""},
    ],
    [{"role": "user", "content": ""}, {"role": "assistant", "content": "naïve — 日本語 🙂 <tool_call> \"quoted\""}],
]
CALCULATOR = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]},
    },
}
TOOLS_HEADER = (
    "Tools:\n<tools>\n" + json.dumps(CALCULATOR["function"]) + "\n</tools>\n"
    'Call one as <tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call><|im_end|>\n'
)


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer(512)


def render(tok, messages, tools=None, generation_prompt=False, template=None) -> str:
    return tok.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=generation_prompt,
                                   chat_template=template)


def call(arguments, name="calculator", call_id="call_0") -> dict:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


@pytest.mark.parametrize("messages", PLAIN_CONVERSATIONS)
@pytest.mark.parametrize("generation_prompt", [False, True])
def test_plain_conversations_render_byte_identical_to_plain_chatml(tok, messages, generation_prompt):
    want = render(tok, messages, generation_prompt=generation_prompt, template=PLAIN_CHATML)
    assert render(tok, messages, generation_prompt=generation_prompt) == want
    assert render(tok, messages, tools=[], generation_prompt=generation_prompt) == want  # no tools: no header


def test_tools_go_into_the_system_turn(tok):
    user = {"role": "user", "content": "What is 37 + 58?"}
    assert render(tok, [user], tools=[CALCULATOR], generation_prompt=True) == (
        "<|im_start|>system\n" + TOOLS_HEADER + "<|im_start|>user\nWhat is 37 + 58?<|im_end|>\n<|im_start|>assistant\n"
    )
    system = {"role": "system", "content": "Be brief."}
    assert render(tok, [system, user], tools=[CALCULATOR]) == (
        "<|im_start|>system\nBe brief.\n\n" + TOOLS_HEADER + "<|im_start|>user\nWhat is 37 + 58?<|im_end|>\n"
    )
    # A tool given without the OpenAI wrapper is listed as it is; one line per tool.
    bare = {"name": "echo", "parameters": {"type": "object", "properties": {}}}
    text = render(tok, [user], tools=[CALCULATOR, bare])
    assert "<tools>\n" + json.dumps(CALCULATOR["function"]) + "\n" + json.dumps(bare) + "\n</tools>" in text


def test_tool_calls_and_tool_results_in_qwen_format(tok):
    args = {"expression": "37 + 58"}
    messages = [
        {"role": "user", "content": "What is 37 + 58?"},
        {"role": "assistant", "content": None, "tool_calls": [call(args)]},
        {"role": "tool", "tool_call_id": "call_0", "content": "95"},
        {"role": "assistant", "content": "\\boxed{95}"},
    ]
    want = (
        "<|im_start|>system\n" + TOOLS_HEADER + "<|im_start|>user\nWhat is 37 + 58?<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "37 + 58"}}\n'
        "</tool_call><|im_end|>\n"
        "<|im_start|>user\n<tool_response>\n95\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n\\boxed{95}<|im_end|>\n"
    )
    assert render(tok, messages, tools=[CALCULATOR]) == want
    # Arguments as a JSON string (OpenAI's wire format), content "" or left out: the same text.
    for content in ({"content": ""}, {}):
        messages[1] = {"role": "assistant", **content, "tool_calls": [call(json.dumps(args))]}
        assert render(tok, messages, tools=[CALCULATOR]) == want
    # A string is used as it is, even when json.dumps would space it differently.
    messages[1] = {"role": "assistant", "tool_calls": [call('{"expression":"37+58"}')]}
    assert '{"name": "calculator", "arguments": {"expression":"37+58"}}' in render(tok, messages, tools=[CALCULATOR])


def test_content_before_calls_several_calls_and_grouped_tool_results(tok):
    messages = [
        {"role": "user", "content": "Two sums."},
        {"role": "assistant", "content": "Let me compute.", "tool_calls": [
            call({"expression": "1 + 2"}), call('{"expression": "3 + 4"}', call_id="call_1")]},
        {"role": "tool", "tool_call_id": "call_0", "content": "3"},
        {"role": "tool", "tool_call_id": "call_1", "content": [{"type": "text", "text": "7"}]},
    ]
    assert render(tok, messages, tools=[CALCULATOR], generation_prompt=True).endswith(
        "<|im_start|>assistant\nLet me compute.\n"
        '<tool_call>\n{"name": "calculator", "arguments": {"expression": "1 + 2"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "calculator", "arguments": {"expression": "3 + 4"}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\n3\n</tool_response>\n<tool_response>\n7\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    # A tool message after a user message opens its own user turn.
    tail = [{"role": "user", "content": "x"}, {"role": "tool", "content": "y"}]
    assert render(tok, tail).endswith("<|im_end|>\n<|im_start|>user\n<tool_response>\ny\n</tool_response><|im_end|>\n")


def parse_qwen_call(text: str) -> dict:
    """What a proxy does with generated text: the call's JSON -> an OpenAI tool call (arguments re-serialised)."""
    match = re.fullmatch(r"(.*?)\n?<tool_call>\n(.*)\n</tool_call>", text, re.DOTALL)
    assert match, text
    parsed = json.loads(match.group(2))
    return {"role": "assistant", "content": match.group(1) or None,
            "tool_calls": [call(json.dumps(parsed["arguments"]))]}


@pytest.mark.parametrize("content", ["", "I will use the calculator."])
@pytest.mark.parametrize("expression", ["37 + 58", "(12 * 3) // 5 % 7", "9 - 10"])
def test_a_generated_tool_call_renders_back_to_the_same_text(tok, content, expression):
    """Earlier turns' tokens must match a fresh rendering of the conversation once the proxy has
    turned the generated text into a structured call and the agent sent it back."""
    messages = [{"role": "user", "content": f"What is {expression}?"}]
    prompt = render(tok, messages, tools=[CALCULATOR], generation_prompt=True)
    call_json = json.dumps({"name": "calculator", "arguments": {"expression": expression}})  # default spacing
    generated = (content + "\n" if content else "") + f"<tool_call>\n{call_json}\n</tool_call>"
    assistant = parse_qwen_call(generated)
    again = render(tok, [*messages, assistant], tools=[CALCULATOR])
    assert again == prompt + generated + "<|im_end|>\n"
    # ... and the conversation stays prefix-stable as the tool result and the next prompt are added.
    tool = {"role": "tool", "tool_call_id": "call_0", "content": "42"}
    assert render(tok, [*messages, assistant, tool], tools=[CALCULATOR], generation_prompt=True).startswith(again)


def test_the_template_survives_save_and_reload(tok, tmp_path):
    save_tokenizer(tok, tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path, local_files_only=True)
    messages = [{"role": "user", "content": "What is 1 + 1?"},
                {"role": "assistant", "tool_calls": [call({"expression": "1 + 1"})]},
                {"role": "tool", "content": "2"}]
    assert render(loaded, messages, tools=[CALCULATOR], generation_prompt=True) == render(
        tok, messages, tools=[CALCULATOR], generation_prompt=True)
    ids = loaded.apply_chat_template(messages, tools=[CALCULATOR], tokenize=True, add_generation_prompt=True)
    ids = ids["input_ids"] if not isinstance(ids, list) else ids
    assert loaded.decode(ids) == render(tok, messages, tools=[CALCULATOR], generation_prompt=True)

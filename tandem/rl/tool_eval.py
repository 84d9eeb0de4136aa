"""The reference tool loop for evaluating a tool-using task offline (`tandem sft`'s eval of the
`calculator` task): greedy generation through the fleet's /generate, the model's tool calls parsed
from Qwen's format and run by the task, the conversation rendered again with the chat template.

A task is tool-using when it has `call_tool(name, arguments) -> str` and its items carry `tools`.
Each episode: generate from the prompt; if the text holds `<tool_call>` blocks that all parse, add
the assistant message with those calls and one `tool` message per call, render the conversation
with the generation prompt and generate again (at most `max_turns` generations); otherwise the text
is the answer and goes to the reward. A `<tool_call>` block that does not parse ends the episode
with the raw text as the answer (it scores 0 on a boxed-answer task).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tandem.data.tasks.base import item_messages
from tandem.data.tasks.chat import encode_prompt
from tandem.fleet.generation import GenerationParams
from tandem.rollout.client import InferenceClient
from tandem.rollout.types import ModelRequest

ToolRunner = Callable[[str, Any], str]
_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


class MalformedToolCall(ValueError):
    pass


def parse_tool_calls(text: str) -> tuple[str, list[dict[str, Any]]]:
    """(content, calls) of generated text in Qwen's format: the content is the text before the
    first `<tool_call>` (its newline dropped), each call `{"name": str, "arguments": dict}`.
    Text without `<tool_call>` is all content and no calls. Raises `MalformedToolCall` when a block
    is not closed or its JSON is not an object with a string `name` and object `arguments`."""
    start = text.find("<tool_call>")
    if start < 0:
        return text, []
    blocks = _BLOCK.findall(text, start)
    if text.count("<tool_call>") != len(blocks):
        raise MalformedToolCall("a <tool_call> is not closed")
    calls = []
    for block in blocks:
        try:
            call = json.loads(block)
        except (ValueError, RecursionError):
            raise MalformedToolCall(f"not JSON: {block.strip()[:80]!r}") from None
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            raise MalformedToolCall(f"not an object with a name: {block.strip()[:80]!r}")
        arguments = call.get("arguments", {})
        if not isinstance(arguments, dict):
            raise MalformedToolCall(f"arguments are not an object: {block.strip()[:80]!r}")
        calls.append({"name": call["name"], "arguments": arguments})
    content = text[:start]
    return content[:-1] if content.endswith("\n") else content, calls


@dataclass
class ToolEpisode:
    answer: str  # the text that is scored
    answer_ids: list[int]  # its tokens (the last generation)
    generated: int = 0  # tokens generated over all turns
    turns: int = 0  # generations
    calls: int = 0  # tool calls run
    first_turn_call: bool = False  # the first generation was a well-formed tool call
    malformed: bool = False  # a <tool_call> block did not parse
    answered: bool = False  # ended with a turn without tool calls (not by max_turns or a malformed call)
    messages: list[dict[str, Any]] = field(default_factory=list)


async def tool_episode(client: InferenceClient, item: dict[str, Any], tokenizer: Any, params: GenerationParams,
                       call_tool: ToolRunner, max_turns: int = 4, system_prompt: str | None = None) -> ToolEpisode:
    """Run the tool loop on one item (see the module docstring); the first prompt is `item["input_ids"]`."""
    messages = item_messages(item, system_prompt)
    tools = item.get("tools")
    ids = list(item["input_ids"]) if "input_ids" in item else encode_prompt(item, tokenizer, system_prompt)
    episode = ToolEpisode(answer="", answer_ids=[])
    for turn in range(max_turns):
        resp = await client.agenerate(ModelRequest(ids, params))
        text = tokenizer.decode(resp.output_ids, skip_special_tokens=True)
        episode.turns += 1
        episode.generated += len(resp.output_ids)
        episode.answer, episode.answer_ids = text, list(resp.output_ids)
        try:
            content, calls = parse_tool_calls(text)
        except MalformedToolCall:
            episode.malformed = True
            break
        if not calls:
            episode.answered = True
            break
        episode.first_turn_call = episode.first_turn_call or turn == 0
        if turn == max_turns - 1:
            episode.answer, episode.answer_ids = "", []  # still calling tools: no answer
            break
        call_ids = [f"call_{turn}_{i}" for i in range(len(calls))]
        messages.append({"role": "assistant", "content": content, "tool_calls": [
            {"id": cid, "type": "function", "function": {"name": c["name"], "arguments": json.dumps(c["arguments"])}}
            for cid, c in zip(call_ids, calls, strict=True)]})
        for cid, c in zip(call_ids, calls, strict=True):
            messages.append({"role": "tool", "tool_call_id": cid, "content": call_tool(c["name"], c["arguments"])})
            episode.calls += 1
        ids = encode_prompt({"messages": messages, "tools": tools}, tokenizer)
    episode.messages = messages
    return episode

"""The offline tool loop that evaluates a tool-using task (`tandem sft`'s eval of the calculator task)."""

from __future__ import annotations

import asyncio
import json

import pytest

from tandem.data.tasks import get_task, with_input_ids
from tandem.data.tasks.chat import encode_completion, render
from tandem.fleet.generation import GenerationParams
from tandem.rl.evaluate import _evaluate, tool_loop_of
from tandem.rl.tool_eval import MalformedToolCall, parse_tool_calls, tool_episode
from tandem.rollout.reward import RewardRunner
from tandem.rollout.types import ModelRequest, ModelResponse


def call_text(expression: str) -> str:
    return "<tool_call>\n" + json.dumps({"name": "calculator", "arguments": {"expression": expression}}) + "\n</tool_call>"


@pytest.mark.parametrize(("text", "content", "calls"), [
    ("\\boxed{95}", "\\boxed{95}", []),
    (call_text("1 + 2"), "", [{"name": "calculator", "arguments": {"expression": "1 + 2"}}]),
    ("Let me.\n" + call_text("3") + "\n" + call_text("4"), "Let me.",
     [{"name": "calculator", "arguments": {"expression": "3"}}, {"name": "calculator", "arguments": {"expression": "4"}}]),
    ('<tool_call>{"name": "f"}</tool_call>', "", [{"name": "f", "arguments": {}}]),
])
def test_parse_tool_calls(text, content, calls):
    assert parse_tool_calls(text) == (content, calls)


@pytest.mark.parametrize("text", [
    "<tool_call>\n{\"name\": \"calculator\", \"arguments\": {\"expression\": \"1\"}}",  # cut off by max tokens
    "<tool_call>\n{\"name\": \"calculator\", \"arguments\": {\"expression\": \"1\"}\n</tool_call>",  # bad JSON
    "<tool_call>\n[\"calculator\"]\n</tool_call>",
    "<tool_call>\n{\"arguments\": {}}\n</tool_call>",
    "<tool_call>\n{\"name\": \"calculator\", \"arguments\": \"1 + 1\"}\n</tool_call>",
])
def test_parse_tool_calls_refuses_malformed_blocks(text):
    with pytest.raises(MalformedToolCall):
        parse_tool_calls(text)


class ScriptedClient:
    """Stands in for InferenceClient: answers each agenerate with the next scripted text (+ EOS)."""

    def __init__(self, tokenizer, scripts: dict[str, list[str]]):
        self.tokenizer, self.scripts = tokenizer, scripts
        self.requests: list[ModelRequest] = []

    async def agenerate(self, req: ModelRequest) -> ModelResponse:
        self.requests.append(req)
        prompt = self.tokenizer.decode(req.input_ids)
        key = next(k for k in self.scripts if f"What is {k}?" in prompt)
        turn = prompt.count("<|im_start|>assistant\n") - 1
        ids = encode_completion(self.scripts[key][turn], self.tokenizer)
        return ModelResponse(req.rid, req.input_ids, ids, [0.0] * len(ids), [0] * len(ids), "stop")

    async def aclose(self) -> None:
        pass


@pytest.fixture(scope="module")
def tok():
    from tandem.models.tiny import build_tokenizer

    return build_tokenizer(512)


def test_a_tool_episode_runs_the_call_and_renders_the_conversation_again(tok):
    task = get_task("calculator", difficulty="add2", instruction=False)
    item = with_input_ids(task.generate(1), tok)[0]
    expression, answer = item["expression"], item["answer"]
    client = ScriptedClient(tok, {expression: [call_text(expression), f"\\boxed{{{answer}}}"]})
    params = GenerationParams(max_new_tokens=100, temperature=0.0)
    ep = asyncio.run(tool_episode(client, item, tok, params, task.call_tool))
    assert (ep.answer, ep.turns, ep.calls, ep.first_turn_call, ep.answered, ep.malformed) == (
        f"\\boxed{{{answer}}}", 2, 1, True, True, False)
    first, second = client.requests
    assert first.input_ids == item["input_ids"] and first.params is params
    # The second prompt is the first, the model's own text, the tool result and a new assistant header.
    assert tok.decode(second.input_ids) == (
        tok.decode(item["input_ids"]) + call_text(expression) + "<|im_end|>\n"
        f"<|im_start|>user\n<tool_response>\n{answer}\n</tool_response><|im_end|>\n<|im_start|>assistant\n")
    assert tok.decode(second.input_ids) == render(tok, ep.messages, item["tools"], add_generation_prompt=True)
    assert ep.messages[-1] == {"role": "tool", "tool_call_id": "call_0_0", "content": answer}


def test_tool_loop_eval_scores_answers_and_counts_calls(tok):
    task = get_task("calculator", difficulty="add2", instruction=False)
    items = with_input_ids(task.generate(4, seed=1, split="eval"), tok)
    a, b, c, d = items
    scripts = {
        a["expression"]: [call_text(a["expression"]), f"\\boxed{{{a['answer']}}}"],  # right, through the tool
        b["expression"]: [call_text(b["expression"].rsplit(" ", 2)[0]), "\\boxed{1}"],  # wrong call, wrong answer
        c["expression"]: [f"\\boxed{{{c['answer']}}}"],  # right, without the tool
        d["expression"]: ["<tool_call>\n{\"name\": \"calculator\""] * 4,  # cut off: malformed
    }
    runner = RewardRunner(max_workers=1, timeout_s=10)
    try:
        stats = asyncio.run(_evaluate(ScriptedClient(tok, scripts), items, task.reward_fn(), runner, tok, 100, 8,
                                      tool_loop_of(task)))
    finally:
        runner.close()
    assert stats["eval/accuracy"] == 0.5 and stats["eval/n"] == 4 and stats["eval/failed"] == 0
    assert stats["eval/tool_call_first_turn"] == 0.5 and stats["eval/malformed_tool_call"] == 0.25
    assert stats["eval/answered"] == 0.75 and stats["eval/turns"] == (2 + 2 + 1 + 1) / 4
    assert stats["eval/tool_calls"] == 0.5
    assert tool_loop_of(get_task("arithmetic")) is None

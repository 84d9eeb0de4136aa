"""The calculator agent against a scripted OpenAI-compatible chat server (aiohttp on 127.0.0.1),
through the real `openai` client: what it sends (tools, tool results, their call ids) and its reward."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from aiohttp import web

from tandem.agents import calculator as agent
from tandem.data.tasks import get_task

openai = pytest.importorskip("openai")


def tool_call(arguments: str, name: str = "calculator", call_id: str = "call_a") -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def reply(content: str | None = None, calls: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = calls
    return message


class ScriptedChatServer:
    """Answers POST /v1/chat/completions with the scripted assistant messages in order (the last one
    again when the script runs out) and keeps every request body."""

    def __init__(self, script: list[dict[str, Any]]):
        self.script = script
        self.requests: list[dict[str, Any]] = []

    async def _chat(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.requests.append(body)
        message = self.script[min(len(self.requests), len(self.script)) - 1]
        return web.json_response({
            "id": f"chatcmpl-{len(self.requests)}", "object": "chat.completion", "created": 0, "model": body["model"],
            "choices": [{"index": 0, "message": message,
                         "finish_reason": "tool_calls" if message.get("tool_calls") else "stop"}],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
        })

    async def run_agent(self, item: dict[str, Any]) -> float:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self._chat)
        runner = web.AppRunner(app, shutdown_timeout=0.1, handle_signals=False)
        await runner.setup()
        try:
            await web.TCPSite(runner, "127.0.0.1", 0).start()
            port = runner.addresses[0][1]
            client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0,
                                        timeout=30)
            try:
                return await agent.run(client, item)
            finally:
                await client.close()
        finally:
            await runner.cleanup()


@pytest.fixture
def item() -> dict[str, Any]:
    item = get_task("calculator", difficulty="add2").generate(1)[0]
    return {**item, "expression": "37 + 58", "answer": "95", "prompt": "What is 37 + 58?",
            "messages": [{"role": "user", "content": "What is 37 + 58?"}]}


def run(script: list[dict[str, Any]], item: dict[str, Any]) -> tuple[float, list[dict[str, Any]]]:
    server = ScriptedChatServer(script)
    reward = asyncio.run(server.run_agent(item))
    return reward, server.requests


def test_calls_the_tool_sends_the_result_back_and_scores_the_answer(item):
    call = tool_call(json.dumps({"expression": "37 + 58"}))
    reward, requests = run([reply(None, [call]), reply("\\boxed{95}")], item)
    assert reward == 1.0 and len(requests) == 2
    first, second = requests
    # Only model, messages and tools: the proxy applies the run's sampling settings itself.
    assert set(first) == {"model", "messages", "tools"} and first["model"] == "policy"
    assert first["messages"] == item["messages"] and first["tools"] == item["tools"]
    assistant, result = second["messages"][1:]
    assert assistant["role"] == "assistant" and assistant["tool_calls"] == [call]
    assert assistant.get("content") in (None, "")
    assert result == {"role": "tool", "tool_call_id": "call_a", "content": "95"}
    assert second["tools"] == item["tools"]


def test_answers_without_the_tool_in_one_request(item):
    reward, requests = run([reply("It is \\boxed{96}.")], item)
    assert reward == 0.0 and len(requests) == 1


def test_mistaken_calls_get_error_results_and_the_loop_goes_on(item):
    calls = [
        tool_call('{"expression": "37 +"}', call_id="c1"),
        tool_call('{"expression": ', call_id="c2"),
        tool_call('{"expression": "1"}', name="search", call_id="c3"),
        tool_call('{"expr": "37 + 58"}', call_id="c4"),
        tool_call('{"expression": "37 + 5"}', call_id="c5"),
    ]
    reward, requests = run([reply("Let me compute.", calls), reply("\\boxed{42}")], item)
    assert reward == 0.0 and len(requests) == 2
    sent = requests[1]["messages"]
    assert sent[1]["content"] == "Let me compute." and len(sent[1]["tool_calls"]) == 5
    results = {m["tool_call_id"]: m["content"] for m in sent[2:]}
    assert [m["role"] for m in sent[2:]] == ["tool"] * 5
    assert results["c1"] == "error: not an arithmetic expression"
    assert results["c2"] == "error: the arguments are not valid JSON"
    assert results["c3"].startswith("error: unknown tool 'search'")
    assert results["c4"].startswith("error: the arguments must be")
    assert results["c5"] == "42"


def test_stops_after_max_turns(item):
    call = tool_call(json.dumps({"expression": "37 + 58"}))
    reward, requests = run([reply("\\boxed{95}", [call])], item)  # calls the tool forever
    assert len(requests) == agent.MAX_TURNS == 4
    assert reward == 0.0  # no answer without a tool call: the boxed text beside the calls does not count
    assert len(requests[-1]["messages"]) == 1 + 2 * (agent.MAX_TURNS - 1)

"""The calculator agent: the built-in agent of the `calculator` task (`tandem.data.tasks.calculator`).

    rollout: {workflow: agent, agent: {entry: tandem.agents.calculator:run}}

Ordinary agent code over the OpenAI client it is given (sends only `model`, `messages`, `tools`):
each turn it runs the model's tool calls with the task's calculator and sends the results back,
until the model answers without a tool call or after `MAX_TURNS` requests (then the answer is
empty). The reward is the task's, of that answer. A bad tool call gets an error text as its
result; it never raises."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tandem.data.tasks.calculator import CalculatorTask, call_tool

if TYPE_CHECKING:
    import openai

MAX_TURNS = 4
MODEL = "policy"  # the proxy serves the current policy under any name
_TASK = CalculatorTask()  # the reward with the task's default options


def tool_result(call: Any) -> str:
    """The text result of one tool call of a chat completion (a function call, else an error)."""
    function = getattr(call, "function", None)
    if function is None:
        return "error: only function tool calls are supported"
    return call_tool(function.name, function.arguments)


async def run(client: openai.AsyncOpenAI, item: dict[str, Any]) -> float:
    """Solve `item` with the calculator; the reward of the final answer (1.0 when it is right)."""
    messages: list[dict[str, Any]] = [dict(m) for m in item["messages"]]
    final = ""
    for _ in range(MAX_TURNS):
        completion = await client.chat.completions.create(model=MODEL, messages=messages, tools=item["tools"])
        message = completion.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            final = message.content or ""
            break
        for call in message.tool_calls:
            messages.append({"role": "tool", "tool_call_id": call.id, "content": tool_result(call)})
    return _TASK.reward(final, item)

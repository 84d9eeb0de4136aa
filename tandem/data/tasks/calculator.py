"""Arithmetic with a calculator tool: the built-in agentic task.

Items are the arithmetic task's (default `mixed3`) plus `tools`, the one tool `CALCULATOR_TOOL`; the
reward checks the final answer exactly as arithmetic's does. `sft_messages(item)` is the reference
conversation (question, tool call, tool result, `\boxed{N}`; `teacher_slip` leaves out the last term
in a share of them). `evaluate_expression` is the tool: an exact, bounded `ast` whitelist that
returns a string for the model to read (a number, or `error: ...`) and never raises. See
docs/tasks.md, "calculator"."""

from __future__ import annotations

import ast
import json
import operator
from fractions import Fraction
from typing import Any

from tandem.data.tasks.arithmetic import ArithmeticTask
from tandem.data.tasks.base import item_messages

TOOL_NAME = "calculator"
CALCULATOR_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": TOOL_NAME,
        "description": "Evaluate an arithmetic expression.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string"}},
            "required": ["expression"],
        },
    },
}


def calculator_tool() -> dict[str, Any]:
    """A fresh copy of `CALCULATOR_TOOL` (each item owns its own)."""
    return json.loads(json.dumps(CALCULATOR_TOOL))


INSTRUCTION = "Use the calculator, then put your final answer in \\boxed{}."
MAX_EXPRESSION_CHARS = 200
MAX_DIGITS = 60  # every literal and intermediate value stays below 10**60 in absolute value

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


class _Refused(Exception):
    """An expression the calculator does not evaluate; the message is shown to the model."""


def _bounded(value: Fraction) -> Fraction:
    if abs(value) >= 10**MAX_DIGITS:
        raise _Refused(f"a number has more than {MAX_DIGITS} digits")
    return value


def _value(node: ast.AST) -> Fraction:
    if isinstance(node, ast.Constant):
        if type(node.value) is not int:
            raise _Refused(f"only integers are allowed, not {node.value!r}")
        return _bounded(Fraction(node.value))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_value(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _value(node.left), _value(node.right)
        if right == 0 and not isinstance(node.op, ast.Add | ast.Sub | ast.Mult):
            raise _Refused("division by zero")
        return _bounded(_BINARY[type(node.op)](left, right))
    raise _Refused("only integers, parentheses and + - * / // % are allowed")


def format_number(value: Fraction) -> str:
    """An integer as its digits; any other value as a decimal of up to 10 significant digits."""
    return str(value.numerator) if value.denominator == 1 else f"{float(value):.10g}"


def evaluate_expression(expression: str) -> str:
    """The value of an arithmetic expression as text (`"36155"`, `"3.5"`), or `"error: ..."`."""
    if not isinstance(expression, str):
        return "error: the expression must be a string"
    text = expression.strip()
    if not text:
        return "error: the expression is empty"
    if len(text) > MAX_EXPRESSION_CHARS:
        return f"error: the expression is longer than {MAX_EXPRESSION_CHARS} characters"
    try:
        return format_number(_value(ast.parse(text, mode="eval").body))
    except _Refused as exc:
        return f"error: {exc}"
    except (SyntaxError, ValueError):
        return "error: not an arithmetic expression"
    except Exception:  # RecursionError, MemoryError, anything unforeseen: the model sees an error
        return "error: the expression cannot be evaluated"


def call_tool(name: str, arguments: Any) -> str:
    """Run one tool call of the calculator task: `arguments` is a dict or its JSON text. An unknown
    tool or malformed arguments give an error text for the model, never an exception."""
    if name != TOOL_NAME:
        return f"error: unknown tool {name!r}; the only tool is {TOOL_NAME}"
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except (ValueError, RecursionError):
            return "error: the arguments are not valid JSON"
    if not isinstance(arguments, dict) or not isinstance(arguments.get("expression"), str):
        return 'error: the arguments must be {"expression": "<an arithmetic expression>"}'
    return evaluate_expression(arguments["expression"])


def tool_call_message(expression: str, call_id: str = "call_0", content: str = "") -> dict[str, Any]:
    """An assistant message that calls the calculator, as an OpenAI client sends it back."""
    arguments = json.dumps({"expression": expression})
    return {"role": "assistant", "content": content, "tool_calls": [
        {"id": call_id, "type": "function", "function": {"name": TOOL_NAME, "arguments": arguments}}]}


class CalculatorTask(ArithmeticTask):
    """Options as arithmetic's (without `reasoning`); `instruction` adds `INSTRUCTION` to the prompt."""

    name = "calculator"

    def __init__(
        self,
        difficulty: str = "mixed3",
        digits: int | None = None,
        ops: str | None = None,
        terms: int | None = None,
        allow_negative: bool = False,
        instruction: bool = True,
        eval_fraction: float = 0.2,
        format_weight: float = 0.0,
        system_prompt: str | None = None,
        teacher_slip: float = 0.0,
    ):
        super().__init__(difficulty=difficulty, digits=digits, ops=ops, terms=terms, allow_negative=allow_negative,
                         instruction=instruction, eval_fraction=eval_fraction, format_weight=format_weight,
                         system_prompt=system_prompt, teacher_slip=teacher_slip)

    def prompt_text(self, expression: str) -> str:
        return f"What is {expression}?" + (f" {INSTRUCTION}" if self.instruction else "")

    def generate(self, n: int, seed: int = 0, split: str = "train") -> list[dict[str, Any]]:
        return [{**item, "tools": [calculator_tool()]} for item in super().generate(n, seed, split)]

    def reference_expression(self, item: dict[str, Any]) -> str:
        """The expression the reference conversation sends to the tool (the last term left out on a slip)."""
        tokens = item["expression"].split()
        return " ".join(tokens[:-2]) if self.slips(item) else item["expression"]

    def sft_messages(self, item: dict[str, Any]) -> list[dict[str, Any]]:
        expression = self.reference_expression(item)
        result = evaluate_expression(expression)
        return [
            *item_messages(item),
            tool_call_message(expression),
            {"role": "tool", "tool_call_id": "call_0", "content": result},
            {"role": "assistant", "content": f"\\boxed{{{result}}}"},
        ]

    def sft_target(self, item: dict[str, Any]) -> str:
        """The reference conversation's final answer (its last turn)."""
        return self.sft_messages(item)[-1]["content"]

"""Countdown: reach a target from given numbers with + - * / and parentheses, each number at most once.

Items are solvable by construction: numbers are drawn, combined at random into an expression
(subtractions stay positive, divisions exact), and its value becomes the target; the expression
is kept as the reference `answer` and hidden from the prompt.

The reward checks a completion's expression safely, without `eval`: the span (last `\\boxed{}`,
else last `<answer>`, else the last non-empty line; left of the first '=' if there is one) is parsed
with `ast` and only integer literals, + - * /, and parentheses are accepted. Each literal must be one
of the given numbers, used at most as often as given (all of them if `must_use_all`); the value is
computed with exact fractions, and a division by zero, anything else, or a wrong value scores 0.
"""

from __future__ import annotations

import ast
import random
from collections import Counter
from fractions import Fraction
from typing import Any

from tandem.data.tasks.base import Task, TaskError, check_fraction
from tandem.data.tasks.extract import answer_span

PRESETS: dict[str, dict[str, int]] = {
    "easy": {"num_numbers": 3, "max_number": 10, "max_target": 50},
    "medium": {"num_numbers": 4, "max_number": 20, "max_target": 100},
    "hard": {"num_numbers": 5, "max_number": 50, "max_target": 500},
}
INSTRUCTION = "Put your final answer in \\boxed{}."
MAX_EXPRESSION_CHARS = 200

_PRECEDENCE = {"+": 1, "-": 1, "*": 2, "/": 2}
_AST_OPS = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/"}
_REPLACEMENTS = {"×": "*", "÷": "/", "−": "-", "\\times": "*", "\\cdot": "*", "\\div": "/",
                 "\\left": "", "\\right": "", "{": "(", "}": ")"}

# An expression tree: an int leaf, or (op, left, right).
Tree = int | tuple[str, "Tree", "Tree"]


def render(tree: Tree) -> str:
    """Compact infix with only the parentheses precedence needs: ('*', ('+', 3, 5), 3) -> '(3+5)*3'."""
    if isinstance(tree, int):
        return str(tree)
    op, left, right = tree
    ls, rs = render(left), render(right)
    if not isinstance(left, int) and _PRECEDENCE[left[0]] < _PRECEDENCE[op]:
        ls = f"({ls})"
    if not isinstance(right, int) and (
        _PRECEDENCE[right[0]] < _PRECEDENCE[op] or (_PRECEDENCE[right[0]] == _PRECEDENCE[op] and op in "-/")
    ):
        rs = f"({rs})"
    return f"{ls}{op}{rs}"


def tree_steps(tree: Tree) -> list[tuple[int, str, int, int]]:
    """(a, op, b, value) for every operation, innermost first."""
    if isinstance(tree, int):
        return []
    op, left, right = tree
    a, b = tree_value(left), tree_value(right)
    return [*tree_steps(left), *tree_steps(right), (a, op, b, tree_value(tree))]


def tree_value(tree: Tree) -> int:
    if isinstance(tree, int):
        return tree
    op, left, right = tree
    a, b = tree_value(left), tree_value(right)
    return a + b if op == "+" else a - b if op == "-" else a * b if op == "*" else a // b


class _Invalid(Exception):
    pass


def _evaluate(node: ast.AST, budget: Counter) -> Fraction:
    """Exact value of a whitelisted expression; spends one of `budget` per literal; raises _Invalid."""
    if isinstance(node, ast.Expression):
        return _evaluate(node.body, budget)
    if isinstance(node, ast.Constant) and type(node.value) is int:
        if budget[node.value] <= 0:
            raise _Invalid(f"{node.value} is not available (not given, or used too often)")
        budget[node.value] -= 1
        return Fraction(node.value)
    if isinstance(node, ast.BinOp) and type(node.op) in _AST_OPS:
        a, b = _evaluate(node.left, budget), _evaluate(node.right, budget)
        op = _AST_OPS[type(node.op)]
        if op == "/":
            if b == 0:
                raise _Invalid("division by zero")
            return a / b
        return a + b if op == "+" else a - b if op == "-" else a * b
    raise _Invalid(f"{type(node).__name__} is not allowed")


def expression_of(completion_text: str) -> str:
    """The expression a completion proposes (see the module docstring), normalised for parsing."""
    source, span = answer_span(completion_text)
    if source == "text":
        lines = [line for line in span.splitlines() if line.strip()]
        span = lines[-1] if lines else ""
    span = span.split("=")[0]
    for old, new in _REPLACEMENTS.items():
        span = span.replace(old, new)
    return span.strip().rstrip(".").strip()


def check_expression(expression: str, numbers: list[int], target: int, must_use_all: bool = False) -> bool:
    """True when `expression` is allowed, uses `numbers` correctly and equals `target` exactly."""
    if not expression or len(expression) > MAX_EXPRESSION_CHARS:
        return False
    budget = Counter(int(x) for x in numbers)
    try:
        value = _evaluate(ast.parse(expression, mode="eval"), budget)
    except (_Invalid, SyntaxError, ValueError, RecursionError, MemoryError):
        return False
    if must_use_all and any(budget.values()):
        return False
    return value == target


class CountdownTask(Task):
    name = "countdown"

    def __init__(
        self,
        difficulty: str = "easy",
        num_numbers: int | None = None,
        max_number: int | None = None,
        max_target: int | None = None,
        must_use_all: bool = False,
        reasoning: bool = False,
        instruction: bool = True,
        eval_fraction: float = 0.2,
        format_weight: float = 0.0,
        system_prompt: str | None = None,
    ):
        super().__init__(system_prompt=system_prompt, format_weight=format_weight)
        if difficulty not in PRESETS:
            raise TaskError(f"countdown: unknown difficulty {difficulty!r}; presets: {', '.join(PRESETS)}")
        preset = PRESETS[difficulty]
        self.difficulty = difficulty
        self.num_numbers = preset["num_numbers"] if num_numbers is None else num_numbers
        self.max_number = preset["max_number"] if max_number is None else max_number
        self.max_target = preset["max_target"] if max_target is None else max_target
        if not 2 <= self.num_numbers <= 6:
            raise TaskError(f"countdown: num_numbers must be between 2 and 6, got {self.num_numbers!r}")
        if self.max_number < 2 or self.max_target < 2:
            raise TaskError("countdown: max_number and max_target must be >= 2")
        self.must_use_all = must_use_all
        self.reasoning = reasoning
        self.instruction = instruction
        self.eval_fraction = check_fraction(eval_fraction)

    def _sample(self, rng: random.Random) -> tuple[list[int], Tree]:
        for _ in range(10_000):
            numbers = [rng.randint(1, self.max_number) for _ in range(self.num_numbers)]
            nodes: list[Tree] = list(numbers)
            while len(nodes) > 1:
                i, j = rng.sample(range(len(nodes)), 2)
                a, b = nodes[i], nodes[j]
                va, vb = tree_value(a), tree_value(b)
                op = rng.choice("+-*/")
                if op == "-" and va <= vb:
                    a, b, va, vb = b, a, vb, va
                    if va == vb:
                        op = "+"
                if op == "/" and (vb in (0, 1) or va % vb):
                    op = "*"
                nodes = [n for k, n in enumerate(nodes) if k not in (i, j)] + [(op, a, b)]
            target = tree_value(nodes[0])
            if 1 <= target <= self.max_target and target not in numbers:
                return numbers, nodes[0]
        raise TaskError(f"countdown: could not make a problem with max_target={self.max_target}; raise it")

    def generate(self, n: int, seed: int = 0, split: str = "train") -> list[dict[str, Any]]:
        def key(problem: tuple[list[int], Tree]) -> str:
            return f"{sorted(problem[0])}->{tree_value(problem[1])}"

        problems = self._draw(n, seed, split, self.eval_fraction, self._sample, key=key)
        items = []
        for i, (numbers, tree) in enumerate(problems):
            target = tree_value(tree)
            prompt = (f"Using the numbers {', '.join(map(str, numbers))} and each at most once, "
                      f"reach {target} with + - * /." + (f" {INSTRUCTION}" if self.instruction else ""))
            items.append(self.make_item(i, seed, split, prompt, render(tree), numbers=numbers, target=target))
        return items

    def sft_target(self, item: dict[str, Any]) -> str:
        boxed = f"\\boxed{{{item['answer']}}}"
        if not self.reasoning:
            return boxed
        tree = ast.parse(item["answer"], mode="eval").body
        lines = [f"{a} {op} {b} = {v}" for a, op, b, v in tree_steps(_tree_of(tree))]
        return "<think>\n" + "\n".join(lines) + "\n</think>\n" + boxed

    def reward(self, completion_text: str, item: dict[str, Any]) -> float:
        expression = expression_of(completion_text)
        if check_expression(expression, item["numbers"], int(item["target"]), self.must_use_all):
            return 1.0
        if self.format_weight and answer_span(completion_text)[0] != "text":
            return self.format_weight
        return 0.0


def _tree_of(node: ast.AST) -> Tree:
    """Back from a (trusted, generated) reference expression to a tree, for the reasoning steps."""
    if isinstance(node, ast.Constant):
        return int(node.value)
    if isinstance(node, ast.BinOp):
        return (_AST_OPS[type(node.op)], _tree_of(node.left), _tree_of(node.right))
    raise ValueError(f"not a countdown expression node: {ast.dump(node)}")

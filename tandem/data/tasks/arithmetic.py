"""Integer arithmetic: "What is 37 + 58?" -> 95, with difficulty presets from 1-digit sums up.

Operands have `digits` digits (1: 0..9, 2: 10..99, 3: 100..999), `terms` of them joined by operators
drawn from `ops` (any of "+-*", usual precedence: `*` before `+`/`-`). Results are kept >= 0 unless
`allow_negative`. The answer is extracted by `extract.extract_integer` (last `\\boxed{}`, else last
`<answer>`, else the last number in the completion) and compared exactly as an integer.

`teacher_slip` makes the warm-start data imperfect on purpose, the way a weak teacher's is: that
share of SFT targets (drawn per item, reproducibly) is the value with the last term left out. The
reward always checks the true value, so RL has a systematic mistake to find and remove.
"""

from __future__ import annotations

import random
from typing import Any

from tandem.data.tasks.base import Task, TaskError, check_fraction
from tandem.data.tasks.extract import answer_span, extract_integer, last_number

# Ordered from easiest to hardest.
PRESETS: dict[str, dict[str, Any]] = {
    "add1": {"digits": 1, "ops": "+", "terms": 2},  # 3 + 5 (100 problems)
    "addsub1": {"digits": 1, "ops": "+-", "terms": 2},  # 7 - 2
    "add1x3": {"digits": 1, "ops": "+", "terms": 3},  # 3 + 5 + 8
    "mixed1": {"digits": 1, "ops": "+-*", "terms": 3},  # 3 + 5 * 2
    "add2": {"digits": 2, "ops": "+", "terms": 2},  # 37 + 58
    "addsub2": {"digits": 2, "ops": "+-", "terms": 2},  # 73 - 28
    "mixed2": {"digits": 2, "ops": "+-*", "terms": 2},  # 37 * 58
    "mixed3": {"digits": 3, "ops": "+-*", "terms": 3},  # 137 + 58 * 621
}
INSTRUCTION = "Put your final answer in \\boxed{}."


def evaluate_steps(numbers: list[int], ops: list[str]) -> list[str]:
    """The expression reduced one operation at a time (`*` first, then left to right); last is the value."""
    nums, ops = list(numbers), list(ops)
    steps = [_render(nums, ops)]
    while ops:
        i = ops.index("*") if "*" in ops else 0
        a, b, op = nums[i], nums[i + 1], ops[i]
        nums[i : i + 2] = [a * b if op == "*" else a + b if op == "+" else a - b]
        del ops[i]
        steps.append(_render(nums, ops))
    return steps


def _render(nums: list[int], ops: list[str]) -> str:
    parts = [str(nums[0])]
    for op, n in zip(ops, nums[1:], strict=True):
        parts += [op, str(n)]
    return " ".join(parts)


class ArithmeticTask(Task):
    name = "arithmetic"

    def __init__(
        self,
        difficulty: str = "add2",
        digits: int | None = None,
        ops: str | None = None,
        terms: int | None = None,
        allow_negative: bool = False,
        reasoning: bool = False,
        instruction: bool = True,
        eval_fraction: float = 0.2,
        format_weight: float = 0.0,
        system_prompt: str | None = None,
        teacher_slip: float = 0.0,
    ):
        super().__init__(system_prompt=system_prompt, format_weight=format_weight)
        if difficulty not in PRESETS:
            raise TaskError(f"arithmetic: unknown difficulty {difficulty!r}; presets: {', '.join(PRESETS)}")
        preset = PRESETS[difficulty]
        self.difficulty = difficulty
        self.digits = preset["digits"] if digits is None else digits
        self.ops = preset["ops"] if ops is None else ops
        self.terms = preset["terms"] if terms is None else terms
        if self.digits not in (1, 2, 3):
            raise TaskError(f"arithmetic: digits must be 1, 2 or 3, got {self.digits!r}")
        if not self.ops or set(self.ops) - set("+-*"):
            raise TaskError(f"arithmetic: ops must be a non-empty string of '+', '-', '*', got {self.ops!r}")
        if not 2 <= self.terms <= 5:
            raise TaskError(f"arithmetic: terms must be between 2 and 5, got {self.terms!r}")
        self.allow_negative = allow_negative
        self.reasoning = reasoning
        self.instruction = instruction
        self.eval_fraction = check_fraction(eval_fraction)
        if not 0.0 <= teacher_slip <= 1.0:
            raise TaskError(f"arithmetic: teacher_slip must be in [0, 1] (a share of SFT targets), got {teacher_slip!r}")
        self.teacher_slip = teacher_slip
        self.low = 0 if self.digits == 1 else 10 ** (self.digits - 1)
        self.high = 10**self.digits - 1

    def _sample(self, rng: random.Random) -> tuple[list[int], list[str]]:
        ops_pool = sorted(set(self.ops))
        while True:
            nums = [rng.randint(self.low, self.high) for _ in range(self.terms)]
            ops = [rng.choice(ops_pool) for _ in range(self.terms - 1)]
            if self.allow_negative or int(evaluate_steps(nums, ops)[-1]) >= 0:
                return nums, ops

    def generate(self, n: int, seed: int = 0, split: str = "train") -> list[dict[str, Any]]:
        problems = self._draw(n, seed, split, self.eval_fraction, self._sample, key=lambda p: _render(*p))
        items = []
        for i, (nums, ops) in enumerate(problems):
            expression = _render(nums, ops)
            answer = evaluate_steps(nums, ops)[-1]
            items.append(self.make_item(i, seed, split, self.prompt_text(expression), answer, expression=expression))
        return items

    def prompt_text(self, expression: str) -> str:
        return f"What is {expression}?" + (f" {INSTRUCTION}" if self.instruction else "")

    def slips(self, item: dict[str, Any]) -> bool:
        """Whether the item's reference is the teacher's slip (`teacher_slip`; drawn per item, reproducibly)."""
        return bool(self.teacher_slip) and random.Random(f"slip:{item['id']}").random() < self.teacher_slip

    def sft_target(self, item: dict[str, Any]) -> str:
        tokens = item["expression"].split()
        numbers, ops = [int(t) for t in tokens[::2]], tokens[1::2]
        if self.slips(item):
            numbers, ops = numbers[:-1], ops[:-1]  # the teacher forgets the last term
        steps = evaluate_steps(numbers, ops)
        boxed = f"\\boxed{{{steps[-1]}}}"
        if not self.reasoning:
            return boxed
        return f"<think>\n{' = '.join(steps)}\n</think>\n{boxed}"

    def reward(self, completion_text: str, item: dict[str, Any]) -> float:
        return integer_reward(completion_text, item["answer"], self.format_weight)


def integer_reward(completion_text: str, answer: str | int, format_weight: float = 0.0) -> float:
    """1.0 if the extracted integer equals `answer`; `format_weight` if a marked answer holds a number."""
    if extract_integer(completion_text) == int(answer):
        return 1.0
    source, span = answer_span(completion_text)
    if format_weight and source != "text" and last_number(span) is not None:
        return format_weight
    return 0.0

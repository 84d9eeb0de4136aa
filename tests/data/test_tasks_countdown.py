"""Countdown: solvable generation, safe expression checking, extraction rules."""

from __future__ import annotations

import pytest

from tandem.data.tasks import TaskError, countdown_reward, get_task
from tandem.data.tasks.countdown import PRESETS, check_expression, expression_of, render

ITEM = {"numbers": [3, 5, 3, 8], "target": 24, "answer": "(3+5)*3", "task": "countdown"}


def _key(item):
    return (tuple(sorted(item["numbers"])), item["target"])


@pytest.mark.parametrize("difficulty", list(PRESETS))
def test_generation_is_deterministic_disjoint_and_solvable(difficulty):
    task = get_task("countdown", difficulty=difficulty)
    train, evals = task.generate(100, seed=1), task.generate(40, seed=1, split="eval")
    assert train == task.generate(100, seed=1) and train != task.generate(100, seed=2)
    assert not {_key(i) for i in train} & {_key(i) for i in evals}
    preset = PRESETS[difficulty]
    for it in train + evals:
        assert len(it["numbers"]) == preset["num_numbers"] and max(it["numbers"]) <= preset["max_number"]
        assert 1 <= it["target"] <= preset["max_target"] and it["target"] not in it["numbers"]
        assert str(it["target"]) in it["prompt"] and it["answer"] not in it["prompt"]
        assert check_expression(it["answer"], it["numbers"], it["target"], must_use_all=True)
        assert task.reward(task.sft_target(it), it) == 1.0
        assert countdown_reward("", task.sft_target(it), [], [], **it) == 1.0
    reasoning = get_task("countdown", difficulty=difficulty, reasoning=True)
    for it in train[:20]:
        target = reasoning.sft_target(it)
        assert target.startswith("<think>\n") and reasoning.reward(target, it) == 1.0


def test_render_uses_only_needed_parentheses():
    assert render(("*", ("+", 3, 5), 3)) == "(3+5)*3"
    assert render(("-", 9, ("-", 5, 2))) == "9-(5-2)"
    assert render(("-", ("-", 9, 5), 2)) == "9-5-2"
    assert render(("/", 8, ("*", 2, 2))) == "8/(2*2)"
    assert render(("+", 1, ("*", 2, 3))) == "1+2*3"


@pytest.mark.parametrize(
    ("completion", "reward"),
    [
        ("\\boxed{(3+5)*3}", 1.0),
        ("\\boxed{(3 + 5) × 3}", 1.0),
        ("\\boxed{\\left(3+5\\right) \\times 3}", 1.0),
        ("<answer>(5+3)*3</answer>", 1.0),
        ("<think>try 8*3</think>\n(3+5)*3 = 24", 1.0),  # last line, left of '='
        ("\\boxed{8*3}", 1.0),  # a subset of the numbers is fine
        ("\\boxed{3*8*(5-3)/2}", 0.0),  # 2 is not given
        ("\\boxed{8*3*3/3}", 0.0),  # 3 is given twice, used three times
        ("\\boxed{24}", 0.0),  # the target itself is not a given number
        ("\\boxed{(3+5)*3+1-1}", 0.0),
        ("\\boxed{8*3.0}", 0.0),  # only integer literals
        ("\\boxed{-3+3*8+3}", 0.0),  # no unary minus
        ("\\boxed{3**3-3}", 0.0),  # no power
        ("\\boxed{8//3}", 0.0),
        ("\\boxed{8*(5-5)}", 0.0),
        ("\\boxed{8/(3-3)+24}", 0.0),  # division by zero: 0, not an exception
        ("\\boxed{__import__('os').system('true')}", 0.0),
        ("\\boxed{(3).real*8}", 0.0),  # attribute access
        ("\\boxed{x*8}", 0.0),  # names
        ("\\boxed{[3][0]*8}", 0.0),
        ("\\boxed{(lambda: 24)()}", 0.0),
        ("\\boxed{" + "(" * 300 + "3" + ")" * 300 + "}", 0.0),  # too long / too deep
        ("\\boxed{(3+5)*3", 0.0),  # unclosed box: last line '\\boxed{(3+5)*3' is no expression
        ("", 0.0),
        ("I give up", 0.0),
    ],
)
def test_reward_checks_expressions_safely(completion, reward):
    assert get_task("countdown").reward(completion, ITEM) == reward


def test_exact_fractions_and_must_use_all():
    item = {"numbers": [1, 3, 4, 6], "target": 24}
    assert check_expression("6/(1-3/4)", item["numbers"], 24)  # needs exact 1/4, not floats
    assert not check_expression("6*4", item["numbers"], 24, must_use_all=True)
    strict = get_task("countdown", must_use_all=True)
    assert strict.reward("\\boxed{6*4}", item) == 0.0 and strict.reward("\\boxed{6/(1-3/4)}", item) == 1.0


def test_format_weight_and_expression_extraction():
    shaped = get_task("countdown", format_weight=0.1)
    assert shaped.reward("\\boxed{3+5}", ITEM) == 0.1
    assert shaped.reward("3+5", ITEM) == 0.0
    assert expression_of("first line\n\n  (3+5)*3 = 24.  \n\n") == "(3+5)*3"
    assert expression_of("\\boxed{3 ÷ 3 − 1}") == "3 / 3 - 1"


def test_options_are_checked():
    with pytest.raises(TaskError, match="num_numbers"):
        get_task("countdown", num_numbers=9)
    with pytest.raises(TaskError, match="unknown difficulty"):
        get_task("countdown", difficulty="extreme")

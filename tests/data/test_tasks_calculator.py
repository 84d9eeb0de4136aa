"""The calculator task (its tool, items, reference conversations, reward) and multi-turn SFT encoding."""

from __future__ import annotations

import json
import pickle

import pytest

from tandem.data.tasks import (
    CALCULATOR_TOOL,
    CalculatorTask,
    TemplateError,
    calculator_reward,
    encode_completion,
    encode_conversation,
    encode_prompt,
    encode_sft_pair,
    evaluate_expression,
    get_task,
    sft_example,
    task_reward,
    with_input_ids,
)
from tandem.data.tasks.calculator import MAX_DIGITS, call_tool


@pytest.fixture(scope="module")
def tok():
    from tandem.models.tiny import build_tokenizer

    return build_tokenizer(512)


# ---------------------------------------------------------------- the tool


@pytest.mark.parametrize(("expression", "value"), [
    ("37 + 58", "95"),
    ("137 + 58 * 621", "36155"),
    (" (1 + 2) * 3 ", "9"),
    ("7 / 2", "3.5"),
    ("10 / 5", "2"),
    ("1 / 3", "0.3333333333"),
    ("7 // 2", "3"),
    ("-7 % 3", "2"),
    ("-(3) + +4", "1"),
    ("9 - 10", "-1"),
    ("2 * " * 20 + "1", str(2**20)),
])
def test_evaluate_expression_values(expression, value):
    assert evaluate_expression(expression) == value


@pytest.mark.parametrize(("expression", "error"), [
    ("1 / 0", "division by zero"),
    ("5 % (2 - 2)", "division by zero"),
    ("3 // 0", "division by zero"),
    ("2 ** 3", "only integers, parentheses"),
    ("abc", "only integers, parentheses"),
    ("__import__('os').system('true')", "only integers, parentheses"),
    ("[1, 2]", "only integers, parentheses"),
    ("1.5 + 1", "only integers are allowed"),
    ("True + 1", "only integers are allowed"),
    ("'a' * 3", "only integers are allowed"),
    ("1 +", "not an arithmetic expression"),
    ("1; 2", "not an arithmetic expression"),
    ("", "empty"),
    ("   ", "empty"),
    ("1" * (MAX_DIGITS + 1), f"more than {MAX_DIGITS} digits"),
    ("99999 * " * 14 + "99999", f"more than {MAX_DIGITS} digits"),
    ("1 + " * 60 + "1", "longer than 200 characters"),
    ("(" * 99 + "1" + ")" * 99, None),  # nested deeply but within the length: evaluated or refused, never raised
])
def test_evaluate_expression_refuses_with_a_message_and_never_raises(expression, error):
    result = evaluate_expression(expression)
    if error is None:
        assert result == "1" or result.startswith("error: ")
    else:
        assert result.startswith("error: ") and error in result, result


def test_evaluate_expression_takes_anything():
    for value in (None, 5, b"1 + 1", ["1"]):
        assert evaluate_expression(value) == "error: the expression must be a string"


def test_call_tool_accepts_dicts_and_json_text_and_explains_mistakes():
    assert call_tool("calculator", {"expression": "2 + 3"}) == "5"
    assert call_tool("calculator", '{"expression": "2 * 3"}') == "6"
    assert "unknown tool 'search'" in call_tool("search", {"expression": "1"})
    assert "not valid JSON" in call_tool("calculator", '{"expression": ')
    for bad in ('["1 + 1"]', '{"expr": "1"}', {"expression": 5}, None, "[" * 100_000):
        result = call_tool("calculator", bad)
        assert result.startswith("error: ") and "arguments" in result, (bad, result)


# ---------------------------------------------------------------- items, conversations, reward


def test_items_carry_the_tool_and_follow_the_arithmetic_generators():
    task = get_task("calculator")
    assert isinstance(task, CalculatorTask) and task.difficulty == "mixed3"
    train, evals = task.generate(50, seed=1), task.generate(20, seed=1, split="eval")
    assert train == task.generate(50, seed=1)
    assert not {it["expression"] for it in train} & {it["expression"] for it in evals}
    for it in train + evals:
        assert it["task"] == "calculator" and it["id"].startswith(f"calculator-{it['split']}-1-")
        assert it["tools"] == [CALCULATOR_TOOL] and it["tools"][0] is not CALCULATOR_TOOL
        assert it["prompt"] == f"What is {it['expression']}? Use the calculator, then put your final answer in \\boxed{{}}."
        assert it["messages"] == [{"role": "user", "content": it["prompt"]}]
        assert evaluate_expression(it["expression"]) == it["answer"]
        nums = it["expression"].split()[::2]
        assert len(nums) == 3 and all(len(n) == 3 for n in nums)
    plain = get_task("calculator", difficulty="add2", instruction=False, system_prompt="Be brief.").generate(1)[0]
    assert plain["messages"] == [{"role": "system", "content": "Be brief."},
                                 {"role": "user", "content": f"What is {plain['expression']}?"}]
    assert pickle.loads(pickle.dumps(train[0])) == train[0]


def test_the_reference_conversation_calls_the_tool_and_answers_with_its_result():
    task = get_task("calculator")
    item = task.generate(1)[0]
    user, call, result, final = task.sft_messages(item)
    assert user == item["messages"][0]
    assert call["role"] == "assistant" and call["content"] == ""
    (tool_call,) = call["tool_calls"]
    assert tool_call["function"] == {"name": "calculator", "arguments": json.dumps({"expression": item["expression"]})}
    assert result == {"role": "tool", "tool_call_id": tool_call["id"], "content": item["answer"]}
    assert final == {"role": "assistant", "content": f"\\boxed{{{item['answer']}}}"}
    assert task.sft_target(item) == final["content"] and task.reward(final["content"], item) == 1.0


def test_teacher_slip_leaves_out_the_last_term_of_the_call():
    items = get_task("calculator").generate(400, seed=2)
    slip = get_task("calculator", teacher_slip=0.6)
    slipped = 0
    for it in items:
        _, call, result, final = slip.sft_messages(it)
        expression = json.loads(call["tool_calls"][0]["function"]["arguments"])["expression"]
        if expression != it["expression"]:
            slipped += 1
            assert expression == " ".join(it["expression"].split()[:-2])
            assert result["content"] == evaluate_expression(expression) != it["answer"]
            assert slip.reward(final["content"], it) == 0.0  # the reward checks the true value
        assert slip.sft_messages(it) == slip.sft_messages(it)  # drawn per item, reproducibly
    assert 0.5 < slipped / len(items) < 0.7


def test_rewards_of_the_final_answer():
    task = get_task("calculator", format_weight=0.1)
    item = task.generate(1)[0]
    fields = {k: v for k, v in item.items() if k not in ("messages", "prompt", "id")}
    right, wrong = f"\\boxed{{{item['answer']}}}", f"\\boxed{{{int(item['answer']) + 1}}}"
    assert task.reward(right, item) == 1.0 and task.reward(wrong, item) == 0.1 and task.reward("", item) == 0.0
    for fn in (calculator_reward, task_reward, pickle.loads(pickle.dumps(task.reward_fn()))):
        assert fn("p", right, [1], [2], **fields) == 1.0
    assert calculator_reward("p", wrong, [1], [2], **fields) == 0.0
    assert task.reward_fn()("p", wrong, [1], [2], **fields) == 0.1


# ---------------------------------------------------------------- multi-turn SFT encoding


def test_sft_example_trains_on_both_assistant_turns_only(tok):
    task = get_task("calculator", difficulty="add2")
    item = task.generate(1)[0]
    ex = sft_example(item, tok, task)
    full = tok.apply_chat_template(task.sft_messages(item), tools=item["tools"], tokenize=False)
    assert tok.decode(ex["input_ids"]) + "\n" == full  # the whole rendering up to the last EOS
    assert ex["prompt_ids"] == encode_prompt(item, tok) == with_input_ids([item], tok)[0]["input_ids"]
    assert ex["input_ids"] == ex["prompt_ids"] + ex["completion_ids"]
    # The masked tokens are two runs: the tool call and the answer, each closed by EOS.
    runs, current = [], []
    for token, m in zip(ex["input_ids"], ex["loss_mask"], strict=True):
        if m:
            current.append(token)
        elif current:
            runs, current = [*runs, current], []
    runs.append(current)
    call = f'<tool_call>\n{{"name": "calculator", "arguments": {{"expression": "{item["expression"]}"}}}}\n</tool_call>'
    assert runs == [encode_completion(call, tok), encode_completion(f"\\boxed{{{item['answer']}}}", tok)]
    assert tok.decode(ex["input_ids"][: ex["loss_mask"].index(1)]).endswith("<|im_start|>assistant\n")
    # The tool result sits between the turns, unmasked.
    between = ex["input_ids"][len(ex["prompt_ids"]) + len(runs[0]) : -len(runs[1])]
    assert tok.decode(between) == (f"\n<|im_start|>user\n<tool_response>\n{item['answer']}\n</tool_response><|im_end|>\n"
                                   "<|im_start|>assistant\n")
    assert encode_sft_pair(item, tok, task) == (ex["prompt_ids"], ex["completion_ids"])


def test_single_turn_examples_are_prompt_plus_target_and_eos(tok):
    task = get_task("arithmetic", difficulty="add1x3")
    for item in task.generate(20, seed=0):
        for system in (None, "Be brief."):
            ex = sft_example(item, tok, task, system)
            prompt, completion = encode_prompt(item, tok, system), encode_completion(task.sft_target(item), tok)
            assert ex["input_ids"] == prompt + completion
            assert ex["loss_mask"] == [0] * len(prompt) + [1] * len(completion)
            assert sft_example(item, tok, task.sft_target(item), system) == ex


def test_a_template_that_rewrites_earlier_turns_is_refused(tok):
    # Renders only the last assistant message in full: adding a turn changes the earlier text.
    template = (
        "{%- for m in messages -%}<|im_start|>{{ m['role'] }}\n"
        "{% if m['role'] == 'assistant' and not loop.last %}(earlier){% else %}{{ m['content'] }}{% endif -%}"
        "<|im_end|>\n{% endfor -%}{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif -%}"
    )
    messages = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                {"role": "user", "content": "c"}, {"role": "assistant", "content": "d"}]
    original = tok.chat_template
    try:
        tok.chat_template = template
        with pytest.raises(TemplateError, match="not prefix-stable at message 3"):
            encode_conversation(messages, tok)
        assert sum(encode_conversation(messages[:2], tok)["loss_mask"]) == len(encode_completion("b", tok))
    finally:
        tok.chat_template = original
    with pytest.raises(ValueError, match="no assistant message"):
        encode_conversation(messages[:1], tok)

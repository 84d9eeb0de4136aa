"""Task interface, registry, arithmetic generation and rewards, answer extraction, chat encoding."""

from __future__ import annotations

import asyncio
import pickle

import pytest

from tandem.data.tasks import (
    ArithmeticTask,
    TaskError,
    arithmetic_reward,
    encode_prompt,
    encode_sft_pair,
    extract_integer,
    get_task,
    register_task,
    sft_example,
    split_of,
    task_reward,
    with_input_ids,
)
from tandem.data.tasks.arithmetic import PRESETS, evaluate_steps
from tandem.errors import ConfigError


def _keys(items):
    return {it["expression"] for it in items}


# ---------------------------------------------------------------- registry and interface


def test_registry_builds_tasks_and_rejects_unknown_names_and_options():
    assert isinstance(get_task("arithmetic", difficulty="add1"), ArithmeticTask)
    with pytest.raises(TaskError, match=r"unknown task 'nope'.*arithmetic, calculator, code, countdown, gsm8k"):
        get_task("nope")
    with pytest.raises(TaskError, match=r"no option 'digit'.*digits"):
        get_task("arithmetic", digit=2)
    with pytest.raises(ConfigError, match="unknown difficulty 'add9'"):
        get_task("arithmetic", difficulty="add9")
    with pytest.raises(TaskError, match="unknown split 'dev'"):
        get_task("arithmetic").generate(3, split="dev")
    with pytest.raises(TaskError, match="already registered"):
        register_task("arithmetic", ArithmeticTask)


@pytest.mark.parametrize("difficulty", list(PRESETS))
def test_generation_is_deterministic_disjoint_and_self_consistent(difficulty):
    task = get_task("arithmetic", difficulty=difficulty)
    train = task.generate(60, seed=3, split="train")
    assert train == task.generate(60, seed=3, split="train")
    assert train != task.generate(60, seed=4, split="train")
    evals = task.generate(30, seed=3, split="eval")
    assert not _keys(train) & _keys(evals)
    assert not _keys(task.generate(60, seed=9)) & _keys(task.generate(30, seed=1, split="eval"))
    for it in train + evals:
        assert {"id", "prompt", "messages", "answer", "task", "split"} <= set(it)
        assert it["task"] == "arithmetic" and it["messages"][-1] == {"role": "user", "content": it["prompt"]}
        assert int(it["answer"]) == eval(it["expression"].replace(" ", ""))  # trusted, generated text
        assert int(it["answer"]) >= 0  # allow_negative=False
        assert task.reward(task.sft_target(it), it) == 1.0
        assert task.reward(f"\\boxed{{{int(it['answer']) + 1}}}", it) == 0.0
    assert len({it["id"] for it in train}) == len(train)
    if difficulty not in ("add1", "addsub1"):  # big enough spaces: no repeats inside a split
        assert len(_keys(train)) == len(train)


def test_presets_respect_digits_ops_and_terms():
    for name, preset in PRESETS.items():
        task = get_task("arithmetic", difficulty=name)
        for it in task.generate(50, seed=0):
            tokens = it["expression"].split()
            nums, ops = tokens[::2], tokens[1::2]
            assert len(nums) == preset["terms"] and set(ops) <= set(preset["ops"])
            assert all(len(n) == preset["digits"] for n in nums), (name, it["expression"])


def test_small_problem_space_splits_and_repeats():
    task = get_task("arithmetic", difficulty="add1")  # 100 problems in all
    train, evals = task.generate(500, seed=0), task.generate(100, seed=0, split="eval")
    n_train, n_eval = len(_keys(train)), len(_keys(evals))
    assert n_train + n_eval == 100 and 5 <= n_eval <= 35  # eval_fraction 0.2 of 100, by hash
    assert all(split_of(f"arithmetic:{k}", 0.2) == "eval" for k in _keys(evals))


def test_options_override_presets_and_negative_results():
    task = get_task("arithmetic", difficulty="add1", ops="-", digits=2, allow_negative=True)
    answers = [int(it["answer"]) for it in task.generate(100, seed=0)]
    assert min(answers) < 0 and all("-" in it["expression"] for it in task.generate(5))
    assert task.reward(f"\\boxed{{{answers[0]}}}", task.generate(100, seed=0)[0]) == 1.0
    with pytest.raises(TaskError, match="ops"):
        get_task("arithmetic", ops="/")
    with pytest.raises(TaskError, match="digits"):
        get_task("arithmetic", digits=4)


def test_evaluate_steps_follows_precedence():
    assert evaluate_steps([3, 4, 5], ["+", "*"]) == ["3 + 4 * 5", "3 + 20", "23"]
    assert evaluate_steps([9, 4, 2], ["-", "-"]) == ["9 - 4 - 2", "5 - 2", "3"]
    task = get_task("arithmetic", difficulty="mixed1", reasoning=True)
    item = {"expression": "3 + 4 * 5", "answer": "23"}
    assert task.sft_target(item) == "<think>\n3 + 4 * 5 = 3 + 20 = 23\n</think>\n\\boxed{23}"


def test_teacher_slip_flaws_a_share_of_sft_targets_but_never_the_reward():
    items = get_task("arithmetic", difficulty="add1x3").generate(2000, seed=3)
    clean = get_task("arithmetic", difficulty="add1x3")
    slip = get_task("arithmetic", difficulty="add1x3", teacher_slip=0.6, reasoning=False)
    dropped = 0
    for it in items:
        a, b, _ = (int(t) for t in it["expression"].split()[::2])
        target = slip.sft_target(it)
        assert target in (clean.sft_target(it), f"\\boxed{{{a + b}}}")
        assert target == slip.sft_target(it)  # reproducible per item
        dropped += target == f"\\boxed{{{a + b}}}" and a + b != int(it["answer"])
        assert slip.reward(clean.sft_target(it), it) == 1.0
    share = dropped / len(items)
    assert 0.5 < share < 0.6  # 0.6 of targets slip; those whose last term is 0 stay right
    think = get_task("arithmetic", difficulty="add1x3", teacher_slip=1.0, reasoning=True)
    it = {"id": "x", "expression": "3 + 4 + 5", "answer": "12"}
    assert think.sft_target(it) == "<think>\n3 + 4 = 7\n</think>\n\\boxed{7}"
    with pytest.raises(TaskError, match="teacher_slip"):
        get_task("arithmetic", teacher_slip=1.5)


# ---------------------------------------------------------------- answer extraction


@pytest.mark.parametrize(
    ("completion", "expected"),
    [
        ("\\boxed{95}", 95),
        ("the sum is 12, so \\boxed{95}", 95),  # boxed beats a later or earlier bare number
        ("\\boxed{95} and then 12", 95),
        ("\\boxed{3} no wait \\boxed{ 95 }", 95),  # several boxed: the last one, whitespace ignored
        ("\\boxed{-7}", -7),
        ("\\boxed {−7}", -7),  # unicode minus, space before the brace
        ("\\boxed{37+58=95}", 95),  # the last number inside the span
        ("\\boxed{1,234}", 1234),
        ("\\boxed{95.0}", 95),
        ("\\boxed{9.5}", None),  # not an integer
        ("\\boxed{}", None),
        ("\\boxed{x}", None),  # a boxed answer decides, even without a number
        ("<answer>42</answer>", 42),
        ("<answer> -3 </answer> later 8", -3),
        ("<answer>1</answer><answer>2</answer>", 2),
        ("\\boxed{5} <answer>6</answer>", 5),  # boxed preferred over answer tags
        ("37 + 58 = 95", 95),  # no marked answer: the last number
        ("so it is -12.", -12),
        ("10-5", 5),  # a minus between numbers is an operator, not a sign
        ("10 - 5", 5),
        ("x2", None),
        ("\n  95  \n", 95),
        ("no digits here", None),
        ("", None),
        ("\\boxed{95", 95),  # an unclosed box is ignored: the last number of the text
    ],
)
def test_extract_integer(completion, expected):
    assert extract_integer(completion) == expected


def test_reward_is_exact_and_format_weight_is_optional():
    item = get_task("arithmetic").generate(1)[0]
    ans = int(item["answer"])
    plain, shaped = get_task("arithmetic"), get_task("arithmetic", format_weight=0.1)
    assert plain.reward(f"\\boxed{{{ans}}}", item) == 1.0 == shaped.reward(f"\\boxed{{{ans}}}", item)
    assert plain.reward(f"the answer is {ans}", item) == 1.0  # unmarked last number still counts
    assert plain.reward(f"\\boxed{{{ans + 10}}}", item) == 0.0
    assert shaped.reward(f"\\boxed{{{ans + 10}}}", item) == 0.1  # right format, wrong value
    assert shaped.reward(f"{ans + 10}", item) == 0.0  # no marked answer: no format credit
    with pytest.raises(TaskError, match="format_weight"):
        get_task("arithmetic", format_weight=1.0)


# ---------------------------------------------------------------- reward glue


def test_reward_functions_have_the_runner_signature_and_pickle():
    task = get_task("arithmetic", difficulty="add1", format_weight=0.2)
    item = task.generate(1)[0]
    fields = {k: v for k, v in item.items() if k not in ("input_ids", "messages", "prompt", "id")}
    good, bad = task.sft_target(item), "\\boxed{-1}"
    for fn in (arithmetic_reward, task_reward, task.reward_fn()):
        clone = pickle.loads(pickle.dumps(fn))
        assert clone("p", good, [1], [2], **fields) == 1.0
    assert arithmetic_reward("p", bad, [1], [2], **fields) == 0.0
    assert pickle.loads(pickle.dumps(task.reward_fn()))("p", bad, [1], [2], **fields) == 0.2
    assert task.reward_fn().__name__ == "arithmetic_reward"


def test_reward_runs_in_the_rollout_reward_pool():
    from tandem.rollout.reward import RewardRunner

    task = get_task("countdown")
    item = task.generate(1)[0]
    fields = {k: v for k, v in item.items() if k not in ("messages", "prompt", "id")}
    runner = RewardRunner(max_workers=1, timeout_s=10)

    async def score():
        return await asyncio.gather(
            runner.ascore(task.reward_fn(), item["prompt"], task.sft_target(item), [1], [2], **fields),
            runner.ascore(task_reward, item["prompt"], "\\boxed{__import__('os')}", [1], [2], **fields),
        )

    try:
        good, bad = asyncio.run(score())
    finally:
        runner.close()
    assert (good.value, bad.value) == (1.0, 0.0), (good, bad)


# ---------------------------------------------------------------- chat encoding


@pytest.fixture(scope="module")
def tokenizer():
    from tandem.models.tiny import build_tokenizer

    return build_tokenizer(vocab_size=2048)


def test_prompt_ids_end_with_the_assistant_header(tokenizer):
    item = get_task("arithmetic").generate(1)[0]
    ids = encode_prompt(item, tokenizer)
    header = tokenizer.encode("<|im_start|>assistant\n", add_special_tokens=False)
    assert ids[-len(header) :] == header
    text = tokenizer.decode(ids)
    assert text.startswith("<|im_start|>user\n" + item["prompt"]) and text.endswith("<|im_start|>assistant\n")
    # Same ids as the RLVR workflow computes from the item.
    from tandem.rollout.workflows.rlvr import prompt_ids_of

    assert prompt_ids_of(item, tokenizer) == ids == with_input_ids([item], tokenizer)[0]["input_ids"]


def test_system_prompt_from_task_or_call(tokenizer):
    item = get_task("arithmetic", system_prompt="Be brief.").generate(1)[0]
    assert item["messages"][0] == {"role": "system", "content": "Be brief."}
    text = tokenizer.decode(encode_prompt(item, tokenizer))
    assert text.startswith("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n")
    plain = get_task("arithmetic").generate(1)[0]
    assert tokenizer.decode(encode_prompt(plain, tokenizer, system_prompt="Be brief.")) == text
    assert encode_prompt(item, tokenizer, system_prompt="Other.") == encode_prompt(item, tokenizer)  # item's wins


@pytest.mark.parametrize("reasoning", [False, True])
def test_sft_pair_ends_with_eos_and_round_trips(tokenizer, reasoning):
    task = get_task("arithmetic", difficulty="add2", reasoning=reasoning)
    item = task.generate(1)[0]
    prompt, completion = encode_sft_pair(item, tokenizer, task)
    assert completion[-1] == tokenizer.eos_token_id == tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert tokenizer.eos_token_id not in completion[:-1]
    decoded = tokenizer.decode(completion[:-1], skip_special_tokens=True)
    assert decoded == task.sft_target(item) and task.reward(decoded, item) == 1.0
    ex = sft_example(item, tokenizer, task)
    assert ex["input_ids"] == prompt + completion
    assert ex["loss_mask"] == [0] * len(prompt) + [1] * len(completion)


def test_sequences_stay_short_for_the_demo(tokenizer):
    """Guards the token budget the default job relies on (figures in docs/tasks.md)."""
    limits = {"add1": (29, 7), "add2": (31, 8), "addsub2": (31, 8), "mixed2": (31, 9), "mixed3": (38, 14)}
    for difficulty, (max_prompt, max_target) in limits.items():
        task = get_task("arithmetic", difficulty=difficulty)
        pairs = [encode_sft_pair(it, tokenizer, task) for it in task.generate(100, seed=0)]
        assert max(len(p) for p, _ in pairs) <= max_prompt, difficulty
        assert max(len(c) for _, c in pairs) <= max_target, difficulty

"""Reward functions for the tests; importable, so reward worker processes can unpickle them."""

from __future__ import annotations

import signal
import time


def parity_reward(prompt_text, completion_text, prompt_ids, completion_ids, **fields) -> float:
    """1.0 when the last generated token is even (deterministic with the fake server)."""
    return float(completion_ids[-1] % 2 == 0) if completion_ids else 0.0


def fields_reward(prompt_text, completion_text, prompt_ids, completion_ids, **fields) -> float:
    """Echoes an item field, to check that item fields reach the reward."""
    return float(fields["answer"])


def raising_reward(*args, **fields) -> float:
    raise ValueError("the grader crashed")


def sleepy_reward(*args, **fields) -> float:
    time.sleep(60)  # interrupted by the worker's soft timer
    return 1.0


def stubborn_reward(*args, **fields) -> float:
    signal.signal(signal.SIGALRM, signal.SIG_IGN)  # defeats the soft timer: needs the hard kill
    # 40 s: far past any timeout the tests set, and short of test_reward.py's 60 s pytest-timeout, so
    # that a hard kill that never comes fails the test's own assertions (pytest-timeout's alarm
    # firing inside pytest's report ended a whole xdist run twice, as an INTERNALERROR).
    time.sleep(40)
    return 1.0


def nan_reward(*args, **fields) -> float:
    return float("nan")


def maybe_hang_reward(prompt_text, completion_text, prompt_ids, completion_ids, hang=False, **fields) -> float:
    """Hangs (ignoring the soft timer) for items marked `hang`."""
    if hang:
        stubborn_reward()
    return 1.0


def slow_reward(*args, **fields) -> float:
    """Takes 3 s: long enough to end a run while rewards are in flight."""
    time.sleep(3)
    return 1.0


def eval_hang_reward(prompt_text, completion_text, prompt_ids, completion_ids, split="train", **fields) -> float:
    """Hangs (ignoring the soft timer) on evaluation items; training items score by parity."""
    if split == "eval":
        stubborn_reward()
    return parity_reward(prompt_text, completion_text, prompt_ids, completion_ids)


def first_token_reward(prompt_text, completion_text, prompt_ids, completion_ids, good=(), **fields) -> float:
    """1.0 when the answer starts with one of the item's `good` tokens (multi-turn tests)."""
    return float(bool(completion_ids) and completion_ids[0] in good)


def scripted_reward(prompt_text, completion_text, prompt_ids, completion_ids, **fields) -> float:
    """Does what the completion text says: "raise", "nan", "sleep" (soft timeout), "stubborn"
    (defeats the soft timer), else returns it as a number."""
    if completion_text == "raise":
        raise ValueError("the grader crashed")
    if completion_text == "nan":
        return float("nan")
    if completion_text == "sleep":
        return sleepy_reward()
    if completion_text == "stubborn":
        return stubborn_reward()
    return float(completion_text)


def sandboxed_reward(prompt_text, completion_text, prompt_ids, completion_ids, *, sandbox, program, tests=(),
                     **fields) -> float:
    """Asks for the sandbox: runs the item's `program` against its `tests` (the share passed), or
    alone without tests (1.0 when it exits 0)."""
    if tests:
        return sandbox.run(program, tests).fraction
    return float(sandbox.execute(program).ok)

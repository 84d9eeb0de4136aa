"""Items to token ids with the tokenizer's chat template: rollout prompts and SFT pairs.

The prompt is rendered with `add_generation_prompt=True`, so it ends with the assistant header
(`<|im_start|>assistant\\n` for Qwen-style templates) and generation continues from there. An SFT
completion is the task's `sft_target` tokenised on its own, followed by the EOS token (`<|im_end|>`
for Tandem's tiny tokenizer and Qwen), which is what the policy must learn to emit to stop.
"""

from __future__ import annotations

from typing import Any

from tandem.data.tasks.base import Task


def item_messages(item: dict[str, Any], system_prompt: str | None = None) -> list[dict[str, str]]:
    """The item's chat messages (`messages`, else `prompt` as one user turn), with an optional
    system prompt put first unless the item already starts with one."""
    messages = list(item.get("messages") or [{"role": "user", "content": item["prompt"]}])
    if system_prompt and (not messages or messages[0]["role"] != "system"):
        messages.insert(0, {"role": "system", "content": system_prompt})
    return messages


def _ids(result: Any) -> list[int]:
    # transformers 5 returns a BatchEncoding (dict-like) from apply_chat_template(tokenize=True).
    return list(result["input_ids"] if hasattr(result, "keys") else result)


def encode_prompt(item: dict[str, Any], tokenizer: Any, system_prompt: str | None = None) -> list[int]:
    """Prompt token ids, ending with the assistant header."""
    messages = item_messages(item, system_prompt)
    return _ids(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True))


def encode_completion(text: str, tokenizer: Any) -> list[int]:
    """Completion token ids: `text` (no special tokens added) then EOS."""
    if tokenizer.eos_token_id is None:
        raise ValueError("the tokenizer has no eos_token; SFT completions must end with one")
    return [*tokenizer.encode(text, add_special_tokens=False), tokenizer.eos_token_id]


def encode_sft_pair(
    item: dict[str, Any], tokenizer: Any, task: Task | str, system_prompt: str | None = None
) -> tuple[list[int], list[int]]:
    """(prompt ids, completion ids) for SFT; `task` gives the target (`task.sft_target(item)`) or is it."""
    target = task if isinstance(task, str) else task.sft_target(item)
    return encode_prompt(item, tokenizer, system_prompt), encode_completion(target, tokenizer)


def sft_example(
    item: dict[str, Any], tokenizer: Any, task: Task | str, system_prompt: str | None = None
) -> dict[str, list[int]]:
    """One SFT sequence: `input_ids` = prompt + completion, `loss_mask` 1 on completion tokens only."""
    prompt, completion = encode_sft_pair(item, tokenizer, task, system_prompt)
    return {"input_ids": prompt + completion, "loss_mask": [0] * len(prompt) + [1] * len(completion),
            "prompt_ids": prompt, "completion_ids": completion}


def with_input_ids(items: list[dict[str, Any]], tokenizer: Any, system_prompt: str | None = None) -> list[dict[str, Any]]:
    """Copies of `items` with `input_ids` (the rendered prompt), so rollouts skip the template."""
    return [{**item, "input_ids": encode_prompt(item, tokenizer, system_prompt)} for item in items]

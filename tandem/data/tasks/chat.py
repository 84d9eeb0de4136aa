"""Items to token ids with the tokenizer's chat template: rollout prompts and SFT examples.

The prompt is rendered with `add_generation_prompt=True` (and the item's `tools`, if any), so it
ends with the assistant header (`<|im_start|>assistant\\n` for Qwen-style templates) and generation
continues from there. An SFT example is a whole reference conversation, `task.sft_messages(item)`
(for single-turn tasks: the prompt and one assistant turn, `task.sft_target(item)`), with the loss
on the assistant turns only: each turn's text as the template renders it, tokenised on its own as a
model would generate it, followed by the EOS token (`<|im_end|>` for Tandem's tiny tokenizer and
Qwen), which the policy must learn to emit to stop.
"""

from __future__ import annotations

from typing import Any

from tandem.data.tasks.base import Task, item_messages


class TemplateError(ValueError):
    """The chat template cannot be cut into turns: earlier turns render differently once more are added."""


def _ids(result: Any) -> list[int]:
    # transformers 5 returns a BatchEncoding (dict-like) from apply_chat_template(tokenize=True).
    return list(result["input_ids"] if hasattr(result, "keys") else result)


def render(tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
           add_generation_prompt: bool = False) -> str:
    """The chat template's text of `messages` (with `tools` when given)."""
    return tokenizer.apply_chat_template(messages, tools=tools or None, add_generation_prompt=add_generation_prompt,
                                         tokenize=False)


def encode_prompt(item: dict[str, Any], tokenizer: Any, system_prompt: str | None = None) -> list[int]:
    """Prompt token ids, ending with the assistant header; the item's `tools` go into the template."""
    messages = item_messages(item, system_prompt)
    return _ids(tokenizer.apply_chat_template(messages, tools=item.get("tools") or None, add_generation_prompt=True,
                                              tokenize=True))


def encode_completion(text: str, tokenizer: Any) -> list[int]:
    """Completion token ids: `text` (no special tokens added) then EOS."""
    if tokenizer.eos_token_id is None:
        raise ValueError("the tokenizer has no eos_token; SFT completions must end with one")
    return [*tokenizer.encode(text, add_special_tokens=False), tokenizer.eos_token_id]


def encode_conversation(messages: list[dict[str, Any]], tokenizer: Any,
                        tools: list[dict[str, Any]] | None = None) -> dict[str, list[int]]:
    """`input_ids` of a conversation up to its last assistant turn and a `loss_mask` that is 1 on
    the assistant turns (each turn's text and its EOS), 0 elsewhere.

    The turns are cut out of the template's own rendering: for each assistant message at index k,
    `messages[:k]` with the generation prompt and `messages[:k+1]` are rendered, and each render must
    start with the one before (else `TemplateError`), so the masked tokens are exactly what the
    template writes. Text between assistant turns (the prompt, tool results, the next turn's header)
    is tokenised in one piece; each assistant turn's text separately, then EOS.
    """
    eos = tokenizer.eos_token
    if eos is None:
        raise ValueError("the tokenizer has no eos_token; SFT completions must end with one")
    input_ids: list[int] = []
    loss_mask: list[int] = []
    prompt_len = None
    done = ""  # the text encoded so far
    for k, message in enumerate(messages):
        if message.get("role") != "assistant":
            continue
        before = render(tokenizer, messages[:k], tools, add_generation_prompt=True)
        after = render(tokenizer, messages[: k + 1], tools)
        if not before.startswith(done) or not after.startswith(before):
            raise TemplateError(
                f"the chat template is not prefix-stable at message {k}: rendering more messages changed the text "
                "of earlier ones, so the assistant turns cannot be cut out of one rendering (the template must "
                "render each message independently of the ones after it)")
        turn = after[len(before) :]
        end = turn.rfind(eos)
        if end < 0:
            raise TemplateError(f"the chat template closes the assistant message {k} without {eos!r}: {turn!r}")
        context = tokenizer.encode(before[len(done) :], add_special_tokens=False)
        completion = encode_completion(turn[:end], tokenizer)
        input_ids += context + completion
        loss_mask += [0] * len(context) + [1] * len(completion)
        prompt_len = len(context) if prompt_len is None else prompt_len
        done = before + turn[: end + len(eos)]
    if prompt_len is None:
        raise ValueError("the conversation has no assistant message to train on")
    return {"input_ids": input_ids, "loss_mask": loss_mask,
            "prompt_ids": input_ids[:prompt_len], "completion_ids": input_ids[prompt_len:]}


def sft_example(
    item: dict[str, Any], tokenizer: Any, task: Task | str, system_prompt: str | None = None
) -> dict[str, list[int]]:
    """One SFT sequence from the task's reference conversation (`task.sft_messages(item)`, with the
    item's `tools`), or from `task` itself when it is a string (the one assistant turn's text):
    `input_ids`, `loss_mask` (1 on the assistant turns with their EOS), `prompt_ids` (up to the
    first assistant turn) and `completion_ids` (the rest)."""
    if isinstance(task, str):
        messages = [*item_messages(item), {"role": "assistant", "content": task}]
    else:
        messages = task.sft_messages(item)
    return encode_conversation(item_messages({"messages": messages}, system_prompt), tokenizer, item.get("tools"))


def encode_sft_pair(
    item: dict[str, Any], tokenizer: Any, task: Task | str, system_prompt: str | None = None
) -> tuple[list[int], list[int]]:
    """(prompt ids, completion ids) of `sft_example`; for a single-turn task the completion is the
    target's ids and EOS, for a multi-turn one everything after the prompt (tool results included)."""
    example = sft_example(item, tokenizer, task, system_prompt)
    return example["prompt_ids"], example["completion_ids"]


def with_input_ids(items: list[dict[str, Any]], tokenizer: Any, system_prompt: str | None = None) -> list[dict[str, Any]]:
    """Copies of `items` with `input_ids` (the rendered prompt), so rollouts skip the template."""
    return [{**item, "input_ids": encode_prompt(item, tokenizer, system_prompt)} for item in items]

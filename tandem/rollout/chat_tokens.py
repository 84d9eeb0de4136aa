"""Token ids of a conversation that grows turn by turn, without re-tokenising what the model said.

A multi-turn rollout keeps the ids the policy generated and tokenises only what comes after them:
the rest of the template's closing of the model's turn (the model stops on `<|im_end|>`, the
template also writes the newline after it), then the new messages, then the next assistant
header. That text is what the chat template renders for the longer conversation beyond the
shorter one. Templates that render earlier turns differently once the conversation grows (some
strip reasoning from old turns) cannot be continued this way: `TemplateNotPrefixStable`.
"""

from __future__ import annotations

from typing import Any

from tandem.openai_compat.chat import render_chat

_SENTINEL = "\u2063tandem-assistant-turn\u2063"


class TemplateNotPrefixStable(ValueError):
    """The chat template renders the earlier conversation differently once messages are added."""


class ChatTokens:
    """The chat template of `tokenizer` as token ids, for one set of `tools` (None: no tools) and
    template keyword arguments (e.g. Qwen3's `enable_thinking`). Messages as `parse_chat_request`
    normalises them (tool call arguments as JSON strings)."""

    def __init__(self, tokenizer: Any, tools: list[dict[str, Any]] | None = None,
                 template_kwargs: dict[str, Any] | None = None):
        self.tokenizer, self.tools, self.template_kwargs = tokenizer, tools, template_kwargs
        # What the template writes after an assistant message's content (e.g. "<|im_end|>\n").
        base = self.render([{"role": "user", "content": "x"}, {"role": "assistant", "content": _SENTINEL}], False)
        self.closing_ids = self.encode(base[base.rindex(_SENTINEL) + len(_SENTINEL):])

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        return render_chat(self.tokenizer, messages, self.tools, add_generation_prompt=add_generation_prompt,
                           template_kwargs=self.template_kwargs)

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def prompt_ids(self, messages: list[dict[str, Any]]) -> list[int]:
        """A conversation rendered afresh, ending with the assistant header."""
        return self.encode(self.render(messages))

    def continuation_ids(self, generated: list[int], history: list[dict[str, Any]],
                         new_messages: list[dict[str, Any]]) -> list[int]:
        """Ids that follow `generated` (the model's last turn, the last message of `history`):
        the closing the model did not produce itself, `new_messages`, the next assistant header."""
        before = self.render(history, add_generation_prompt=False)
        after = self.render([*history, *new_messages], add_generation_prompt=True)
        if not after.startswith(before):
            raise TemplateNotPrefixStable("the chat template renders earlier turns differently once a turn is added")
        closing = self.closing_ids
        # The model may have produced part of the closing itself (it stops on <|im_end|>).
        done = next(k for k in range(len(closing), -1, -1) if k == 0 or generated[-k:] == closing[:k])
        return closing[done:] + self.encode(after[len(before):])

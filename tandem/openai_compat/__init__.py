"""The OpenAI chat / completions protocol, shared by every OpenAI-compatible server in tandem
(`tandem serve`'s /v1 routes, the agent proxy): request parsing and checks, chat templates with
tools, tool-call parsing, answers and SSE streams. Pure protocol: no web framework, no engine;
imports only the standard library and `tandem.errors`."""

from tandem.openai_compat.chat import (
    ChatStream,
    chat_completion,
    chat_logprobs,
    parse_tool_calls,
    render_chat,
)
from tandem.openai_compat.completion import CompletionStream, completion_logprobs, text_completion
from tandem.openai_compat.request import (
    DEFAULT_CHAT_MAX_TOKENS,
    DEFAULT_COMPLETION_MAX_TOKENS,
    ChatRequest,
    CompletionRequest,
    OpenAIRequestError,
    parse_chat_request,
    parse_completion_request,
)
from tandem.openai_compat.stream import SSE_DONE, ChoiceOutput, sse, usage
from tandem.openai_compat.tokens import IncrementalText, TokenText, token_bytes, token_text_of

__all__ = [
    "DEFAULT_CHAT_MAX_TOKENS",
    "DEFAULT_COMPLETION_MAX_TOKENS",
    "SSE_DONE",
    "ChatRequest",
    "ChatStream",
    "ChoiceOutput",
    "CompletionRequest",
    "CompletionStream",
    "IncrementalText",
    "OpenAIRequestError",
    "TokenText",
    "chat_completion",
    "chat_logprobs",
    "completion_logprobs",
    "parse_chat_request",
    "parse_completion_request",
    "parse_tool_calls",
    "render_chat",
    "sse",
    "text_completion",
    "token_bytes",
    "token_text_of",
    "usage",
]

"""A real tokenizer for the protocol tests: the tiny models' byte-level BPE, with a Qwen-style
tool-aware chat template."""

from __future__ import annotations

import pytest

from tandem.models.tiny.tokenizer import build_tokenizer
from tests.openai_compat.tool_template import TOOL_CHAT_TEMPLATE


@pytest.fixture(scope="session")
def tokenizer():
    tok = build_tokenizer(512)
    tok.chat_template = TOOL_CHAT_TEMPLATE
    return tok


@pytest.fixture(scope="session")
def token_text(tokenizer):
    return lambda t: tokenizer.decode([t])

"""The tiny models' local tokenizer: exact round trips, atomic specials, offline reload, determinism."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys

import pytest
from transformers import AutoTokenizer

from tandem.models.tiny import build_tokenizer, save_tokenizer, special_token_ids

SAMPLES = {
    "arithmetic": "What is 37 + 58? Put your final answer in \\boxed{}.\n<think>\n37 + 58 = 95\n</think>\n\\boxed{95}",
    "countdown": (
        "Using the numbers 3, 7, 25, 50 and each at most once, reach 139 with + - * /. "
        "Show your work in <think> </think> tags.\n<think>50 * 3 = 150, 150 - 11 = 139</think>\n"
        "<answer>50 * 3 - (7 + 25 - 3 * 7)</answer>"
    ),
    "gsm8k": (
        "Maya buys 12 pencils for $3 each and gets 25% off. How much does she pay?\n"
        "The pencils cost 12*3 = <<12*3=36>>36 dollars.\nThe discount is 36*25/100 = <<36*25/100=9>>9.\n"
        "She pays 36-9 = $27.\n#### 27"
    ),
    "english": "The teacher explained the problem to every student before lunch, and they'd understood it!",
    "unicode": "naïve café — 日本語 🙂 e\u0301 Ωμέγα\t tabs\r\n  and   spaces  \x00 end ",
    "specials_in_text": "<|im_start|>user\nhi<|im_end|>\n<|endoftext|><think>ok</think>",
}
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]
CONVERSATION = [
    {"role": "system", "content": "You are a careful math tutor."},
    {"role": "user", "content": "What is 2 + 3?"},
]
RENDERED = (
    "<|im_start|>system\nYou are a careful math tutor.<|im_end|>\n<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n"
)


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer(2048)


@pytest.mark.parametrize("name", SAMPLES)
def test_round_trip_is_exact_and_adds_no_bos(tok, name: str) -> None:
    text = SAMPLES[name]
    ids = tok.encode(text)
    assert ids == tok.encode(text, add_special_tokens=False)  # no bos/eos is ever added
    assert tok.decode(ids) == text
    assert all(0 <= i < len(tok) for i in ids)


def test_every_byte_string_is_encodable(tok) -> None:
    text = "".join(chr(c) for c in range(1, 0x250)) + "\U0001f600\u200b\ufeff"
    assert tok.decode(tok.encode(text)) == text
    assert tok.unk_token is None


def test_digits_are_one_token_each(tok) -> None:
    text = "12345 + 67890 = 80235, 3.14159 and <<48/2=24>>24 #### 1000000"
    ids = tok.encode(text)
    pieces = [tok.decode([i]) for i in ids]
    assert all(p.isdigit() and len(p) == 1 for p in pieces if any(c.isdigit() for c in p))
    assert sum(p.isdigit() for p in pieces) == sum(c.isdigit() for c in text)


@pytest.mark.parametrize("token", SPECIALS)
def test_specials_are_single_atomic_tokens(tok, token: str) -> None:
    token_id = tok.convert_tokens_to_ids(token)
    assert tok.encode(token) == [token_id]
    ids = tok.encode(f"abc{token}def {token}12")
    assert ids.count(token_id) == 2
    assert token not in tok.decode([i for i in ids if i != token_id])  # never also spelled out in pieces


def test_special_flags_and_conventions(tok) -> None:
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>" and tok.bos_token is None
    assert tok.model_max_length == 4096 and tok.padding_side == "right"
    ids = special_token_ids(tok)
    assert ids == {
        "eos_token_id": tok.eos_token_id,
        "pad_token_id": tok.pad_token_id,
        "bos_token_id": None,
        "im_start_token_id": tok.convert_tokens_to_ids("<|im_start|>"),
    }
    assert len(set(ids.values()) - {None}) == 3
    # Chat specials drop out with skip_special_tokens; the think tags are content and stay.
    text = "<|im_start|>assistant\n<think>hmm</think>\\boxed{4}<|im_end|><|endoftext|>"
    assert tok.decode(tok.encode(text), skip_special_tokens=True) == "assistant\n<think>hmm</think>\\boxed{4}"
    batch = tok(["a", "abc def ghi"], padding=True)
    assert batch["input_ids"][0][1:] == [tok.pad_token_id] * (len(batch["input_ids"][1]) - 1)


def test_chat_template_exact_strings(tok) -> None:
    assert tok.apply_chat_template(CONVERSATION, tokenize=False) == RENDERED
    with_prompt = tok.apply_chat_template(CONVERSATION, tokenize=False, add_generation_prompt=True)
    assert with_prompt == RENDERED + "<|im_start|>assistant\n"
    ids = tok.apply_chat_template(CONVERSATION, tokenize=True, add_generation_prompt=True)
    ids = ids["input_ids"] if not isinstance(ids, list) else ids  # transformers 5 returns a BatchEncoding
    assert ids == tok.encode(with_prompt)
    no_system = tok.apply_chat_template(CONVERSATION[1:], tokenize=False)
    assert no_system == "<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n"


def test_save_and_reload_offline(tok, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    save_tokenizer(tok, tmp_path / "tokenizer")
    loaded = AutoTokenizer.from_pretrained(tmp_path / "tokenizer", local_files_only=True)
    assert loaded.backend_tokenizer.to_str() == tok.backend_tokenizer.to_str()
    assert len(loaded) == len(tok) and special_token_ids(loaded) == special_token_ids(tok)
    assert (loaded.eos_token, loaded.pad_token, loaded.bos_token) == (tok.eos_token, tok.pad_token, None)
    assert loaded.model_max_length == 4096 and loaded.padding_side == "right"
    for text in SAMPLES.values():
        assert loaded.encode(text) == tok.encode(text)
        assert loaded.decode(loaded.encode(text)) == text
    assert loaded.apply_chat_template(CONVERSATION, tokenize=False, add_generation_prompt=True) == (
        RENDERED + "<|im_start|>assistant\n"
    )


def test_build_is_deterministic() -> None:
    assert build_tokenizer(1024).backend_tokenizer.to_str() == build_tokenizer(1024).backend_tokenizer.to_str()


def test_build_is_deterministic_across_processes() -> None:
    # Python's str hashing is salted per process: a set iterated unsorted would change the corpus.
    code = (
        "import hashlib; from tandem.models.tiny import build_tokenizer; "
        "print(hashlib.sha256(build_tokenizer(1024).backend_tokenizer.to_str().encode()).hexdigest())"
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == hashlib.sha256(build_tokenizer(1024).backend_tokenizer.to_str().encode()).hexdigest()


@pytest.mark.parametrize("vocab_size", [320, 512, 1024, 2048, 4096, 8192])
def test_vocab_size_is_exact(vocab_size: int) -> None:
    t = build_tokenizer(vocab_size)
    assert len(t) == vocab_size == t.backend_tokenizer.get_vocab_size(with_added_tokens=True)
    assert sorted(t.get_vocab().values()) == list(range(vocab_size))  # dense ids, nothing past the embedding
    assert t.decode(t.encode(SAMPLES["gsm8k"])) == SAMPLES["gsm8k"]


@pytest.mark.parametrize("vocab_size", [0, 256, 319, 16385])
def test_bad_vocab_size_raises(vocab_size: int) -> None:
    with pytest.raises(ValueError, match=r"vocab_size must be between 320 and \d+"):
        build_tokenizer(vocab_size)


def test_compression_is_real(tok) -> None:
    english = SAMPLES["english"]
    assert len(english) / len(tok.encode(english)) > 3.0
    prompt = "What is 37 + 58? Put your final answer in \\boxed{}."
    assert len(tok.encode(prompt)) <= 22  # 4 digit tokens + ~14 for words/punctuation
    countdown = "Using the numbers 3, 7, 25, 50 and each at most once, reach 139 with + - * /."
    assert len(tok.encode(countdown)) <= 36
    # Even the smallest vocabulary spends its merges on the task text.
    assert len(prompt) / len(build_tokenizer(320).encode(prompt)) > 1.5

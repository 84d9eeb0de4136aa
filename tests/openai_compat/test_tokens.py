"""Tokens in logprobs: pieces of a character are shown by their bytes, so no two tokens collide."""

from __future__ import annotations

from tandem.openai_compat import IncrementalText, token_bytes, token_text_of


def test_pieces_of_characters_show_their_bytes(tokenizer):
    text = "日本 café ok"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    shown = [token_text_of(tokenizer)(t) for t in ids]
    assert all("\ufffd" not in s for s in shown) and "bytes:\\xe6" in shown
    assert b"".join(bytes(token_bytes(s)) for s in shown).decode() == text
    pieces = {token_text_of(tokenizer)(t) for t in range(len(tokenizer)) if "\ufffd" in tokenizer.decode([t])}
    assert len(pieces) == sum("\ufffd" in tokenizer.decode([t]) for t in range(len(tokenizer)))  # all distinct


def test_token_bytes():
    assert token_bytes("ok") == [111, 107] and token_bytes("é") == [195, 169]
    assert token_bytes("bytes:\\xe6\\x97") == [230, 151]
    assert token_bytes("bytes: not hex") == list(b"bytes: not hex")


def test_text_of_a_tokenizer_that_is_not_byte_level():
    class Pieces:  # SentencePiece-like: token strings are not byte-level spellings
        def decode(self, ids):
            return "\ufffd" if ids == [1] else "x"

        def convert_ids_to_tokens(self, token):
            return "<0xE6>"

    text = token_text_of(Pieces())
    assert text(1) == "\ufffd" and text(2) == "x"


def test_incremental_text_follows_the_whole_decode(tokenizer):
    text = "naïve 日本語 café — done. <think>ok</think> 🙂 end"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"] + [0, 2, 300, 301]  # specials, then more
    for skip in (True, False):
        inc = IncrementalText(lambda x, skip=skip: tokenizer.decode(x, skip_special_tokens=skip))
        for i, t in enumerate(ids):
            got, whole = inc.add([t]), tokenizer.decode(ids[:i + 1], skip_special_tokens=skip)
            assert got == whole.rstrip("\ufffd") and "\ufffd" not in got
        inc2 = IncrementalText(lambda x, skip=skip: tokenizer.decode(x, skip_special_tokens=skip))
        assert inc2.add(ids[:5]) == tokenizer.decode(ids[:5], skip_special_tokens=skip).rstrip("\ufffd")
        assert inc2.add(ids[5:]) == tokenizer.decode(ids, skip_special_tokens=skip)


def test_incremental_text_decodes_little_at_a_time():
    seen = []

    def decode(ids):
        seen.append(len(ids))
        return "".join(chr(65 + i % 26) for i in ids)

    inc = IncrementalText(decode)
    for t in range(1000):
        inc.add([t])
    assert len(inc.text) == 1000 and max(seen) <= 2

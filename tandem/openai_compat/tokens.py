"""How a token is shown in logprobs. A token that is only a piece of a UTF-8 character (byte-level
BPE splits characters) decodes to U+FFFD like every other such piece, so it is shown by its bytes
instead, in OpenAI's form `bytes:\\xe6\\x97`; `bytes` entries then hold the real bytes."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

TokenText = Callable[[int], str]  # a token id's text in logprob entries
BYTES_PREFIX = "bytes:"


def _byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE's (GPT-2's) printable stand-in of each byte -> the byte: printable Latin-1
    bytes stand for themselves, the others for 256, 257, ... in byte order."""
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)}
    shifted = iter(range(256, 512))
    return {(chr(b) if b in printable else chr(next(shifted))): b for b in range(256)}


_ALPHABET = _byte_level_alphabet()


def token_text_of(tokenizer: Any) -> TokenText:
    """id -> the token's text for logprobs (cached): its decoded text, or `bytes:\\x..` for a piece of a
    character when the tokenizer is byte-level BPE (its token strings spell bytes in that alphabet)."""
    cache: dict[int, str] = {}

    def text(token: int) -> str:
        if token not in cache:
            cache[token] = _text(tokenizer, token)
        return cache[token]

    return text


def _text(tokenizer: Any, token: int) -> str:
    decoded = tokenizer.decode([token])
    if "\ufffd" not in decoded:
        return decoded
    piece = tokenizer.convert_ids_to_tokens(token)
    if not isinstance(piece, str) or not piece or any(c not in _ALPHABET for c in piece):
        return decoded  # not byte-level: the decoded text is all there is
    raw = bytes(_ALPHABET[c] for c in piece)
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError:  # a piece of a character
        return BYTES_PREFIX + "".join(f"\\x{b:02x}" for b in raw)
    return decoded  # whole characters (a real U+FFFD, or the token string was not byte-level)


def token_bytes(text: str) -> list[int]:
    """The bytes of a token shown as `text` (UTF-8, or those a `bytes:\\x..` text spells)."""
    if text.startswith(BYTES_PREFIX):
        hexes = text[len(BYTES_PREFIX):].split("\\x")[1:]
        if hexes and all(len(h) == 2 for h in hexes):
            try:
                return list(bytes.fromhex("".join(hexes)))
            except ValueError:
                pass
    return list(text.encode())


class IncrementalText:
    """The text of a growing output, for streaming, without decoding the whole output at every
    token: each `add` decodes only the tokens since the last complete piece, after the piece before
    it (context for tokenizers whose decode of a token depends on its left neighbour, such as a
    leading space). A trailing piece of a character (U+FFFD) waits for the rest of its bytes."""

    def __init__(self, decode: Callable[[list[int]], str]):
        self.decode = decode
        self.ids: list[int] = []
        self.text = ""
        self._context = 0  # ids[_context:_done] were decoded already, and give the context
        self._done = 0

    def add(self, token_ids: list[int]) -> str:
        """Append tokens; -> the text so far."""
        self.ids += token_ids
        known = self.decode(self.ids[self._context:self._done])
        grown = self.decode(self.ids[self._context:])
        if len(grown) > len(known) and not grown.endswith("\ufffd"):
            self.text += grown[len(known):]
            self._context, self._done = self._done, len(self.ids)
        return self.text

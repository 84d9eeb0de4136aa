"""Syntax of allocation-mode strings: a recursive-descent parser that yields raw components.

Only the shape of the string is checked here (backends, names, dimension letters and sizes,
brackets); the arithmetic rules (world sizes, expert layout, naming) live in `alloc_rules`.
Whitespace is removed before parsing, so it may appear anywhere, even inside a number; every
position kept on the nodes is an index into the original string so errors point at the right
character there.
"""

from __future__ import annotations

import re
import string
from dataclasses import dataclass, field
from typing import NoReturn

from tandem.errors import AllocationError

INFERENCE_BACKENDS = ("sglang", "vllm", "tandem")
TRAINING_BACKENDS = ("archon", "fsdp", "megatron")
# Allowed dimension letters per backend, in the order messages list them.
BACKEND_DIMS: dict[str, tuple[str, ...]] = {
    **{b: ("d", "t", "p") for b in INFERENCE_BACKENDS},
    "archon": ("d", "p", "t", "c", "e"),
    "fsdp": ("d", "t", "c"),
    "megatron": ("d", "p", "t", "c", "e"),
}
HYBRID_BACKENDS = ("archon", "megatron")  # the only ones with expert parallelism
ATTN_DIMS = ("d", "t", "p", "c")
FFN_DIMS = ("d", "e", "t", "p")  # here 't' is the expert tensor parallel size (etp)

BACKENDS_HINT = f"inference: {', '.join(INFERENCE_BACKENDS)}; training: {', '.join(TRAINING_BACKENDS)}"
HYBRID_EXAMPLE = "archon:(attn:d1p4t2c2|ffn:d1p4t1e4)"

_WORD = re.compile(r"[A-Za-z0-9_]*")
_DIGITS = re.compile(r"[0-9]*")
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
_BARE_DIMS = re.compile(r"(?:[a-z][0-9]+)+\Z")  # 'd4t2' written without a backend


@dataclass(frozen=True)
class Dim:
    """One dimension letter as written: its size, and where the letter is (for error carets)."""

    size: int
    pos: int  # index of the dimension letter in the original string


@dataclass
class RawComponent:
    """One `backend[name]:dims` as written, letters mapped to `Dim`; `attn`/`ffn` are set instead of
    `dims` for the hybrid form. `alloc_rules.resolve_sizes` turns it into `ParallelSizes`."""

    backend: str
    start: int
    name: str | None = None
    name_pos: int | None = None
    dims: dict[str, Dim] = field(default_factory=dict)
    attn: dict[str, Dim] | None = None
    ffn: dict[str, Dim] | None = None
    ffn_pos: int | None = None


class _Cursor:
    """Walks the whitespace-free text while remembering each character's original index."""

    def __init__(self, spec: str):
        kept = [(i, ch) for i, ch in enumerate(spec) if not ch.isspace()]
        self.spec = spec
        self.text = "".join(ch for _, ch in kept)
        # One extra slot for "end of input": just after the last non-space character.
        self._orig = [i for i, _ in kept] + [len(spec.rstrip())]
        self.i = 0

    def peek(self) -> str:
        return self.text[self.i : self.i + 1]

    def startswith(self, prefix: str) -> bool:
        return self.text.startswith(prefix, self.i)

    def take(self, pattern: re.Pattern[str]) -> str:
        match = pattern.match(self.text, self.i)
        assert match is not None  # every pattern used here can match the empty string
        self.i = match.end()
        return match.group()

    def orig(self, i: int | None = None) -> int:
        return self._orig[self.i if i is None else i]

    def fail(self, reason: str, at: int | None = None) -> NoReturn:
        raise AllocationError(reason, self.spec, self.orig(at))


def parse_syntax(spec: str) -> list[list[RawComponent]]:
    """Parse `spec` into '+'-separated groups of '|'-colocated raw components."""
    cur = _Cursor(spec)
    if not cur.text:
        raise AllocationError(
            "allocation mode is empty; give at least one component such as 'sglang:d4+archon:d4'",
            spec,
            None,
        )
    groups = [_group(cur)]
    while cur.peek() == "+":
        cur.i += 1
        groups.append(_group(cur))
    if cur.peek():
        _stray(cur)
    return groups


def _group(cur: _Cursor) -> list[RawComponent]:
    members = [_component(cur)]
    while cur.peek() == "|":
        cur.i += 1
        members.append(_component(cur))
    return members


def _stray(cur: _Cursor) -> NoReturn:
    ch = cur.peek()
    if ch == ")":
        cur.fail("unbalanced ')': there is no matching '('")
    if ch == "]":
        cur.fail("unbalanced ']': there is no matching '['")
    if ch == "[":
        cur.fail("a name goes between the backend and ':', e.g. 'sglang[rollout]:d4'")
    cur.fail(
        f"unexpected character {ch!r} after the dimensions; join components with '+' "
        "(separate devices) or '|' (colocated)"
    )


def _component(cur: _Cursor) -> RawComponent:
    ch = cur.peek()
    if ch in ("", "+", "|"):
        _empty_component(cur)
    start = cur.i
    if ch == "[":
        cur.fail(f"a backend is required before the name, e.g. 'sglang[rollout]:d4' ({BACKENDS_HINT})")
    if ch == "(":
        cur.fail(f"a backend is required before the hybrid layout, e.g. '{HYBRID_EXAMPLE}'")
    word = cur.take(_WORD)
    if not word:
        cur.fail(f"unexpected character {ch!r}; a component starts with a backend, e.g. 'sglang:d4'")
    if word not in BACKEND_DIMS:
        _unknown_backend(cur, word, start)
    comp = RawComponent(backend=word, start=cur.orig(start))
    if cur.peek() == "[":
        _name(cur, comp)
    if cur.peek() != ":":
        if cur.peek() == "]":
            cur.fail("unbalanced ']': there is no matching '['")
        cur.fail(f"expected ':' after backend {word!r}, then dimensions, e.g. '{word}:d2'")
    cur.i += 1
    if cur.peek() == "(" or cur.startswith("attn") or cur.startswith("ffn"):
        if word not in HYBRID_BACKENDS:
            cur.fail(
                f"backend {word!r} does not take the hybrid attn/ffn layout (only archon and megatron "
                f"do); give plain dimensions, e.g. '{word}:d2'"
            )
        _hybrid(cur, comp)
    else:
        kind = "inference" if word in INFERENCE_BACKENDS else "training"
        comp.dims = _dims(cur, BACKEND_DIMS[word], f"{kind} backend {word!r}")
    return comp


def _empty_component(cur: _Cursor) -> NoReturn:
    ch, prev = cur.peek(), cur.i - 1  # prev: the operator just consumed, -1 at the start
    if not ch:
        cur.fail(f"nothing follows the trailing {cur.text[prev]!r}; remove it or add a component", at=prev)
    if prev < 0:
        cur.fail(f"empty component before {ch!r}; remove the leading {ch!r}")
    cur.fail(f"empty component between {cur.text[prev]!r} and {ch!r}; remove one of them")


def _unknown_backend(cur: _Cursor, word: str, start: int) -> NoReturn:
    if _BARE_DIMS.match(word):
        fits_inference = all(ch in "dtp" for ch in word if ch.isalpha())
        example = f"'sglang:{word}' or 'archon:{word}'" if fits_inference else f"'archon:{word}'"
        cur.fail(f"a backend is required before the dimensions, e.g. {example} ({BACKENDS_HINT})", at=start)
    if word in ("attn", "ffn"):
        cur.fail(f"a backend is required before the hybrid layout, e.g. '{HYBRID_EXAMPLE}'", at=start)
    if word.lower() in BACKEND_DIMS:
        cur.fail(f"backend names are lowercase: write {word.lower()!r} instead of {word!r}", at=start)
    cur.fail(f"unknown backend {word!r} ({BACKENDS_HINT})", at=start)


def _name(cur: _Cursor, comp: RawComponent) -> None:
    open_at = cur.i
    cur.i += 1
    name = cur.take(_WORD)
    ch = cur.peek()
    if ch != "]":
        if ch in ("", ":", "+", "|"):
            cur.fail("unbalanced '[': close the name with ']', e.g. 'sglang[rollout]:d4'", at=open_at)
        cur.fail(f"invalid character {ch!r} in a component name; names use letters, digits and '_'")
    if not name:
        cur.fail("empty component name '[]'; write a name, e.g. 'sglang[rollout]:d4', or drop the brackets")
    if not _NAME.match(name):
        cur.fail(f"component name {name!r} must start with a letter or '_'", at=open_at + 1)
    comp.name, comp.name_pos = name, cur.orig(open_at + 1)
    cur.i += 1


def _hybrid(cur: _Cursor, comp: RawComponent) -> None:
    # Inside this layout '|' separates attn from ffn; it is not colocation.
    open_at = None
    if cur.peek() == "(":
        open_at = cur.i
        cur.i += 1
    if not cur.startswith("attn:"):
        cur.fail(f"the hybrid layout starts with 'attn:' and then '|ffn:', e.g. '{HYBRID_EXAMPLE}'")
    cur.i += len("attn:")
    comp.attn = _dims(cur, ATTN_DIMS, "the attention section 'attn:'")
    if cur.peek() != "|":
        cur.fail(
            f"the hybrid layout needs an expert section after the attention dims: add '|ffn:...', e.g. '{HYBRID_EXAMPLE}'"
        )
    cur.i += 1
    if not cur.startswith("ffn:"):
        cur.fail(
            "expected 'ffn:' after '|' in the hybrid layout (there '|' separates attn from ffn); "
            f"e.g. '{HYBRID_EXAMPLE}'"
        )
    comp.ffn_pos = cur.orig()
    cur.i += len("ffn:")
    comp.ffn = _dims(cur, FFN_DIMS, "the expert section 'ffn:'")
    if open_at is not None:
        if cur.peek() != ")":
            cur.fail("unbalanced '(': close the hybrid layout with ')' after the ffn dimensions", at=open_at)
        cur.i += 1


def _dims(cur: _Cursor, allowed: tuple[str, ...], where: str) -> dict[str, Dim]:
    """Read `(letter size)+`; `where` names the backend or section for messages."""
    allowed_text = ", ".join(allowed)
    if not _is_letter(cur.peek()):
        cur.fail(f"expected dimensions for {where}, such as '{allowed[0]}2' (allowed: {allowed_text})")
    dims: dict[str, Dim] = {}
    while _is_letter(cur.peek()):
        letter, at = cur.peek(), cur.i
        if letter not in allowed:
            follower = next((b for b in BACKEND_DIMS if dims and cur.startswith(b)), None)
            if follower:  # 'sglang:d4 archon:d4' lost its operator (whitespace is ignored)
                cur.fail(f"missing '+' or '|' before backend {follower!r}")
            cur.fail(f"dimension {letter!r} is not valid for {where} (allowed: {allowed_text})")
        if letter in dims:
            cur.fail(f"dimension {letter!r} is given twice for {where}; give each dimension once")
        cur.i += 1
        digits = cur.take(_DIGITS)
        if not digits:
            cur.fail(f"dimension {letter!r} needs a size after it, e.g. '{letter}2'")
        if digits[0] == "0":
            if int(digits) == 0:
                cur.fail(f"size of dimension {letter!r} must be at least 1 (omit it to mean 1)", at=at + 1)
            cur.fail(
                f"size {digits!r} of dimension {letter!r} has a leading zero; write '{letter}{int(digits)}'",
                at=at + 1,
            )
        dims[letter] = Dim(int(digits), cur.orig(at))
    return dims


def _is_letter(ch: str) -> bool:
    return ch != "" and ch in string.ascii_letters

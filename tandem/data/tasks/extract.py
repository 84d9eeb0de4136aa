"""Finding the answer in a completion: `\\boxed{...}`, `<answer>...</answer>`, numbers.

The rule shared by the built-in tasks (docs/tasks.md):
1. if the completion has a `\\boxed{...}` (braces balanced, so `\\boxed{\\frac{1}{2}}` works), the
   content of the LAST one is the answer span;
2. else, if it has `<answer>...</answer>`, the content of the last pair;
3. else the whole completion (arithmetic then takes its last number; countdown its last line).
"""

from __future__ import annotations

import re
from fractions import Fraction

_BOXED = re.compile(r"\\boxed\s*\{")
_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)

# A number: optional sign, digits (optionally grouped by thousands with commas), optional decimals.
# A '-' is a sign only when glued to the digits and not preceded by something it could subtract
# from: "x = -5" -> -5, but "10-5" and "10 - 5" -> 5. Digits glued to a letter ("x2") do not count.
NUMBER = re.compile(r"(?<![\w.)\]}])([-−]?)(\d{1,3}(?:,\d{3})+(?!\d)|\d+)(\.\d+)?")


def boxed_contents(text: str) -> list[str]:
    """The contents of every `\\boxed{...}` in order; an unclosed last one is ignored."""
    out = []
    for match in _BOXED.finditer(text):
        depth, start = 1, match.end()
        for i in range(start, len(text)):
            if text[i] == "{":
                depth += 1
            elif text[i] == "}":
                depth -= 1
                if depth == 0:
                    out.append(text[start:i])
                    break
    return out


def answer_tag_contents(text: str) -> list[str]:
    return _ANSWER_TAG.findall(text)


def answer_span(text: str) -> tuple[str, str]:
    """(`source`, `span`): source is "boxed", "answer" (tags) or "text" (no marked answer)."""
    boxed = boxed_contents(text)
    if boxed:
        return "boxed", boxed[-1]
    tagged = answer_tag_contents(text)
    if tagged:
        return "answer", tagged[-1]
    return "text", text


def last_number(text: str) -> Fraction | None:
    """The value of the last number in `text` (exact), or None when there is none."""
    found = None
    for found in NUMBER.finditer(text):  # noqa: B007 - the last match is wanted
        pass
    if found is None:
        return None
    sign, digits, decimals = found.groups()
    value = Fraction(digits.replace(",", "") + (decimals or ""))
    return -value if sign else value


def extract_integer(completion: str) -> int | None:
    """The integer answer of a completion by the rule above; None if absent or not a whole number.

    Inside the span the LAST number counts, so `\\boxed{37+58=95}` gives 95; `95.0` is 95, `9.5` is
    None (not an integer), `1,234` is 1234, `-7` is -7.
    """
    _, span = answer_span(completion)
    value = last_number(span)
    if value is None or value.denominator != 1:
        return None
    return int(value)

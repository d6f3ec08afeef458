"""Answer parsers (a reply with no parsable answer counts as wrong, and is counted).

- `parse_choice`: the last explicit "answer is X" / "Answer: X" (any case, optional
  brackets, "option"/"choice" words), else the last bracketed letter "(X)", else a reply
  that is just a letter ("c", "C.", "**C**"), else a first line starting "X." / "X)";
  the letter must be one of the item's labels. A lowercase letter counts only where it
  cannot be the article "a" (followed by a word).
- `parse_number`: the last explicit marker ("Answer: N", "answer is N", "#### N",
  "\\boxed{N}"), else the last number in the reply. "$", thousands commas and a trailing
  period are dropped; numbers compare as exact decimals (3.50 == 3.5).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from decimal import Decimal, InvalidOperation
from typing import Protocol


class Scored(Protocol):
    """What `score` reads of an item (kvlingo.eval.tasks.prompts.TaskItem is one)."""

    gold: str  # the gold letter (ARC) or canonical number (GSM8K)
    labels: tuple[str, ...]  # ARC choice letters, in order


_THINK = re.compile(r"<think>.*?(</think>|$)", re.S)


def strip_thinking(text: str) -> str:
    """The reply without any think block left in its text."""
    return _THINK.sub("", text)


def _choice_ok(text: str, m: re.Match, labels: Sequence[str]) -> str | None:
    letter = m.group(1)
    if letter.upper() not in labels:
        return None
    if letter.islower():
        # "a" followed by a word is the article ("the answer is a plant"), not a choice.
        rest = text[m.end(1) :]
        if re.match(r"\s*[A-Za-z]", rest) and not re.match(r"\s*[\)\]]", rest):
            return None
    return letter.upper()


_EXPLICIT_CHOICE = re.compile(
    r"answer\s*(?:is|would be|will be)?\s*[:=\-]?\s*(?:option|choice)?\s*[:\-]?\s*[\(\[\*\"']*([A-Za-z])(?![A-Za-z])",
    re.I,
)
_BRACKETED = re.compile(r"[\(\[]([A-Za-z])[\)\]]")
_WHOLE = re.compile(r"^\W*([A-Za-z])\W*$")
_LEADING = re.compile(r"^\W*([A-Z])[\.\):]\s")


def parse_choice(text: str, labels: Sequence[str] = ("A", "B", "C", "D")) -> str | None:
    """The chosen letter (upper case) or None; rules in the module docstring."""
    text = strip_thinking(text)
    for pattern in (_EXPLICIT_CHOICE, _BRACKETED):
        for m in reversed(list(pattern.finditer(text))):
            got = _choice_ok(text, m, labels)
            if got:
                return got
    stripped = text.strip()
    m = _WHOLE.match(stripped)
    if m and m.group(1).upper() in labels:
        return m.group(1).upper()
    first = stripped.splitlines()[0] if stripped else ""
    m = _LEADING.match(first + " ")
    if m and m.group(1) in labels:
        return m.group(1)
    return None


_NUM = r"(-?)\s?\$?\s?(-?)((?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?)(?![\d])"
_NUMBER = re.compile(r"(?<![\w.])" + _NUM)
_EXPLICIT_NUMBER = [
    re.compile(r"####\s*" + _NUM),
    re.compile(r"\\boxed\{\s*" + _NUM),
    re.compile(r"answer\s*(?:is)?\s*[:=]?\s*[\*\s]*" + _NUM, re.I),
]


def canonical_number(sign: str, digits: str) -> str | None:
    try:
        value = Decimal(digits.replace(",", ""))
    except InvalidOperation:
        return None
    if sign:
        value = -value
    out = format(value.normalize(), "f")
    return "0" if out in ("-0", "0") else out


def _number_from(m: re.Match) -> str | None:
    return canonical_number(m.group(1) or m.group(2), m.group(3))


def parse_number(text: str) -> str | None:
    """The final number as a canonical decimal string, or None; rules in the module docstring."""
    text = strip_thinking(text)
    for pattern in _EXPLICIT_NUMBER:
        found = list(pattern.finditer(text))
        if found:
            return _number_from(found[-1])
    found = list(_NUMBER.finditer(text))
    return _number_from(found[-1]) if found else None


def parse_gold_number(answer: str) -> str | None:
    """GSM8K's gold: the number after the last '####'."""
    tail = answer.rsplit("####", 1)[-1]
    m = _NUMBER.search(tail)
    return _number_from(m) if m else None


def score(task: str, item: Scored, reply: str) -> tuple[str | None, bool]:
    """(parsed answer or None, correct)."""
    pred = parse_choice(reply, item.labels) if task == "arc" else parse_number(reply)
    return pred, pred is not None and pred == item.gold

"""Prompt formats (one user turn, rendered with the target's chat template).

- ARC-Challenge: the question, one line per choice ("A. text"), then a request to end
  with "Answer: X". Numeric labels ("1".."4", used by a few items) become letters by
  position, and the gold key with them.
- GSM8K: the question, then a request to reason briefly and end with "Answer: N".
  The gold number is what follows "####" in the reference solution.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

from .parsers import parse_gold_number


@dataclass(frozen=True)
class TaskItem:
    id: str  # the data set's id (ARC) or a hash of the question (GSM8K)
    prompt: str  # the user message
    gold: str  # the gold letter (ARC) or canonical number (GSM8K)
    labels: tuple[str, ...] = ()  # ARC choice letters, in order


LETTERS = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"


def arc_item(row: dict[str, Any]) -> TaskItem:
    texts, labels = row["choices"]["text"], [str(x) for x in row["choices"]["label"]]
    letters = tuple(LETTERS[: len(labels)])  # "1".."4" (and any other labels) become A.. by position
    gold = letters[labels.index(str(row["answerKey"]))]
    lines = "\n".join(f"{l}. {t}" for l, t in zip(letters, texts))
    prompt = (
        "Answer the following multiple-choice question.\n\n"
        f"Question: {row['question']}\n{lines}\n\n"
        f'End your reply with a line of the form "Answer: X", where X is one of {", ".join(letters)}.'
    )
    return TaskItem(str(row.get("id") or _qhash(row["question"])), prompt, gold, letters)


def gsm8k_item(row: dict[str, Any]) -> TaskItem:
    prompt = (
        "Solve the following math problem. Reason step by step, briefly.\n\n"
        f"Question: {row['question']}\n\n"
        'End your reply with a line of the form "Answer: N", where N is the final number only.'
    )
    return TaskItem(_qhash(row["question"]), prompt, parse_gold_number(row["answer"]), ())


def _qhash(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


ITEM_BUILDERS = {"arc": arc_item, "gsm8k": gsm8k_item}


def user_prompt_ids(tok, text: str, enable_thinking: bool) -> list[int]:
    """One user turn through the chat template, up to and including the generation prompt."""
    from ...inputs.models import render_ids

    return render_ids(tok, [{"role": "user", "content": text}], enable_thinking)


def plain_ids(tok, text: str) -> list[int]:
    return list(tok.encode(text, add_special_tokens=False))

"""The answer parsers and scoring of ARC and GSM8K (kvlingo/eval/tasks/parsers.py)."""

from __future__ import annotations

import pytest

from kvlingo.eval.tasks.parsers import parse_choice, parse_gold_number, parse_number, score
from kvlingo.eval.tasks.prompts import gsm8k_item


@pytest.mark.parametrize(
    "text, want",
    [
        ("The answer is (C)", "C"),
        ("The answer is (C).\nI am sure.", "C"),
        ("answer: c", "C"),  # a lowercase letter
        ("b", "B"),
        ("**D**", "D"),
        ("A. Paris, because it is the capital.", "A"),
        ("Between (A) and (B), I pick (B).", "B"),  # several letters: the last bracketed one
        ("Maybe answer is A... no, the answer is D", "D"),  # several explicit answers: the last one
        ("I think the answer is a plant.", None),  # the article, not choice A
        ("A plant needs light to grow.", None),  # a sentence starting with the article
        ("Answer: E", None),  # not one of the labels
        ("I do not know.", None),  # no answer
        ("", None),
        ("<think>\nmaybe (A)\n</think>\n\nAnswer: B", "B"),  # a think block left in the text is ignored
    ],
)
def test_parse_choice(text, want):
    assert parse_choice(text, ("A", "B", "C", "D")) == want


@pytest.mark.parametrize(
    "text, want",
    [
        ("She pays $1,234.50 in total.\nAnswer: $1,234.50", "1234.5"),  # $ and thousands commas
        ("First 3 apples, then 5 more, so 8 in all", "8"),  # several numbers: the last
        ("Answer: 42, which is 6 times 7", "42"),  # the explicit marker beats the last number
        ("The answer is 42.", "42"),  # trailing period
        ("#### 1,000", "1000"),
        ("\\boxed{18} is what we get after 3 steps", "18"),
        ("The temperature fell to -5 degrees.", "-5"),
        ("x = 3.50", "3.5"),
        ("It is 1,000,000.", "1000000"),
        ("There is no number here.", None),  # no answer
        ("", None),
    ],
)
def test_parse_number(text, want):
    assert parse_number(text) == want


def test_gold_numbers_and_scoring():
    row = {"question": "How many?", "answer": "2 + 3 = 5 apples, 1,200 total\n#### 1,205"}
    item = gsm8k_item(row)
    assert parse_gold_number(row["answer"]) == item.gold == "1205"
    assert score("gsm8k", item, "So the answer is 1205.00") == ("1205", True)
    assert score("gsm8k", item, "I think 1,204") == ("1204", False)
    assert score("gsm8k", item, "no idea") == (None, False)

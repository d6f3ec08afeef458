"""Task prompts (kvlingo/eval/tasks/prompts.py): ARC's numeric labels become letters."""

from __future__ import annotations

from kvlingo.eval.tasks.parsers import score
from kvlingo.eval.tasks.prompts import arc_item


def test_arc_prompt_maps_numeric_labels_to_letters():
    row = {
        "id": "x1",
        "question": "Which is a mammal?",
        "answerKey": "3",
        "choices": {"text": ["trout", "frog", "whale", "crow"], "label": ["1", "2", "3", "4"]},
    }
    item = arc_item(row)
    assert item.labels == ("A", "B", "C", "D") and item.gold == "C" and item.id == "x1"
    assert "\nA. trout\nB. frog\nC. whale\nD. crow\n" in item.prompt and '"Answer: X"' in item.prompt
    assert score("arc", item, "The answer is (c)") == ("C", True)
    five = {**row, "choices": {"text": list("vwxyz"), "label": list("ABCDE")}, "answerKey": "E"}
    assert arc_item(five).labels[-1] == "E" and score("arc", arc_item(five), "Answer: E") == ("E", True)

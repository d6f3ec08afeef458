"""Task items split into validation and test halves (kvlingo/eval/tasks/data.py)."""

from __future__ import annotations

import pytest

from kvlingo.eval.tasks.data import split_rows, split_suffix

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: one torch thread per module


def test_item_splits_are_disjoint_halves_in_order():
    rows = list(range(11))
    val, test = split_rows(rows, "validation"), split_rows(rows, "test")
    assert val == list(range(5)) and test == list(range(5, 11)) and split_rows(rows, "all") == rows
    assert (split_suffix("all"), split_suffix("validation"), split_suffix("test")) == ("", "-validation", "-test")
    with pytest.raises(ValueError, match="item split"):
        split_rows(rows, "train")

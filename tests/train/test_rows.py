"""Training rows (kvlingo/train/rows.py): the data order is a function of the seed."""

from __future__ import annotations

import pytest

from kvlingo.train import rows as O

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: one torch thread per module


def test_data_order_is_a_function_of_the_seed():
    a, b = O.data_order(10, 1, 25), O.data_order(10, 1, 25)
    assert a == b and a != O.data_order(10, 2, 25)
    assert sorted(a[:10]) == list(range(10)) and sorted(a[10:20]) == list(range(10)) and a[:10] != a[10:20]
    assert O.fit_selection(10, 4, 3) == O.seeded_order(10, 3, "fit")[:4]

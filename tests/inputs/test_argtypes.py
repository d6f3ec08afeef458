"""The flags' numeric types (kvlingo/inputs/argtypes.py): a count below its minimum, a bound or a number that is
not finite is refused naming the bound."""

from __future__ import annotations

import argparse

import pytest

from kvlingo.inputs.argtypes import number, whole


def test_whole_takes_counts_from_its_minimum_and_names_the_bound():
    assert whole(1)("3") == 3 and whole(0)("0") == 0
    for bad, why in (("0", "below 1"), ("-4", "below 1"), ("x", "not a whole number"), ("1.5", "not a whole number")):
        with pytest.raises(argparse.ArgumentTypeError, match=why):
            whole(1)(bad)


def test_number_refuses_the_bound_itself_when_exclusive_and_anything_not_finite():
    assert number(above=0)("0.5") == 0.5 and number(at_least=0)("0") == 0.0
    for bad in ("0", "-1", "nan", "inf", "-inf"):
        with pytest.raises(argparse.ArgumentTypeError, match="> 0"):
            number(above=0)(bad)
    with pytest.raises(argparse.ArgumentTypeError, match="≥ 0"):
        number(at_least=0)("-0.1")
    with pytest.raises(argparse.ArgumentTypeError, match="not a number"):
        number(at_least=0)("fast")
    with pytest.raises(ValueError):
        number()

"""The speed table's floors (kvlingo/bench/speed.py): the steps faster than their floor are named."""

from __future__ import annotations


def test_below_floor_names_the_steps_faster_than_their_floor():
    from kvlingo.bench.speed import below_floor

    vs = {
        "speedup_fraction_of_limit": 0.5,
        "translate_over_floor": 0.9,
        "new_turn_over_floor": 2.1,
        "reprefill_over_floor": 1.0,
    }
    assert below_floor(vs) == {"translate": 0.9}  # exactly at the floor is not below it; the fraction is no floor

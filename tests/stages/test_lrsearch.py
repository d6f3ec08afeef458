"""The recipe's rate grid (kvlingo/stages/lrsearch.py): half decades around the centre, extended past an edge
winner, diverged rates lose."""

from __future__ import annotations

import math

import pytest

from kvlingo.stages import lrsearch


def test_grid_is_half_decades_around_the_centre():
    assert [lrsearch.lr_for_step(1e-4, k) for k in lrsearch.initial_steps(5)] == [1e-5, 3.16e-5, 1e-4, 3.16e-4, 1e-3]
    assert [lrsearch.lr_for_step(1e-3, k) for k in lrsearch.initial_steps(3)] == [3.16e-4, 1e-3, 3.16e-3]
    assert lrsearch.initial_steps(2) == [0, 1] and lrsearch.initial_steps(1) == [0]
    with pytest.raises(ValueError):
        lrsearch.initial_steps(0)


def brute_force(f, steps):
    """Reference: the lowest finite value over the evaluated steps, ties to the nearest-centre step."""
    finite = [k for k in steps if math.isfinite(f(k))]
    return min(finite, key=lambda k: (f(k), abs(k), k))


@pytest.mark.parametrize(
    "f, size, cap, order, extensions, cap_hit",
    [
        (lambda k: (k - 3) ** 2, 5, 4, [-2, -1, 0, 1, 2, 3, 4], 2, False),  # upper edge twice, then interior
        (lambda k: (k + 4) ** 2, 5, 4, [-2, -1, 0, 1, 2, -3, -4, -5], 3, False),  # lower edge three times
        (lambda k: (k - 1) ** 2, 1, 4, [0, -1, 1, 2], 2, False),  # one rate: both edges at once
        (lambda k: -k, 5, 2, [-2, -1, 0, 1, 2, 3, 4], 2, True),  # monotone: the cap stops it
        (lambda k: -k, 2, 0, [0, 1], 0, True),  # no extension allowed
        (lambda k: abs(k), 5, 4, [-2, -1, 0, 1, 2], 0, False),  # interior at once
    ],
)
def test_search_extends_past_an_edge_winner_until_interior(f, size, cap, order, extensions, cap_hit):
    calls = []

    def evaluate(ks):
        calls.extend(ks)
        return [f(k) for k in ks]

    out = lrsearch.search_lr(evaluate, size, cap)
    assert calls == order and out["order"] == order  # each rate trained once, in this order
    assert out["winner"] == brute_force(f, order)
    assert out["extensions"] == extensions and out["cap_hit"] is cap_hit
    if not cap_hit:  # an interior winner has a measured neighbour on both sides
        assert out["winner"] - 1 in order and out["winner"] + 1 in order


def test_diverged_rates_lose_and_all_diverged_is_an_error():
    kls = {-2: 3.0, -1: 2.0, 0: 1.0, 1: float("nan"), 2: None}
    assert lrsearch.select_step(kls) == 0 and lrsearch.extension_steps(kls, 0) == []
    assert lrsearch.select_step({0: 1.0, 1: 1.0, -1: 1.0}) == 0  # ties go to the centre
    with pytest.raises(ValueError, match="diverged"):
        lrsearch.select_step({0: float("inf"), 1: float("nan")})

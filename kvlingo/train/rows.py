"""The rows training reads, and the seeded orders it reads them in.

Orders are pure functions of (seed, stream name), independent of any global RNG, so a
resumed run and an uninterrupted one see the same rows in the same order.
"""

from __future__ import annotations

import hashlib
import random


def seeded_order(n: int, seed: int, stream: str) -> list[int]:
    """A permutation of range(n) that is a pure function of (seed, stream), independent of global RNG."""
    digest = hashlib.sha256(f"{seed}/{stream}".encode()).digest()
    order = list(range(n))
    random.Random(int.from_bytes(digest[:8], "big")).shuffle(order)
    return order


def fit_selection(n_rows: int, n_fit: int, seed: int) -> list[int]:
    """Row indices of the closed-form fit: the first n_fit of a seeded order."""
    return seeded_order(n_rows, seed, "fit")[:n_fit]


def data_order(n_rows: int, seed: int, length: int) -> list[int]:
    """Distillation row indices: seeded permutations of the train rows, one per epoch, concatenated."""
    order: list[int] = []
    epoch = 0
    while len(order) < length:
        order += seeded_order(n_rows, seed, f"distill/{epoch}")
        epoch += 1
    return order[:length]

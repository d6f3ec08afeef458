"""The translator families: each declares itself in its package (`Family`: options, variants, what it reads) and
keeps its maps beside the declaration (`maps.py`, imported on first use). Importing this package is light (no torch).

    headwise     one affine map per (K/V, layer, KV head)
    crosshead    every target KV head reads every source KV head of the layer at the same relative depth
    crosslayer   ... of the k source layers ranked best for each target layer
    residual     a linear family plus a small MLP per layer
    tokeninput   a linear family plus the target's layer-0 features of each token and the ones before it
"""

from __future__ import annotations

from ..settings import Family, FamilyError, Variant
from .crosslayer import CROSSHEAD, CROSSLAYER
from .headwise import HEADWISE
from .residual import RESIDUAL
from .tokeninput import TOKENINPUT

FAMILIES: dict[str, Family] = {f.name: f for f in (HEADWISE, CROSSHEAD, CROSSLAYER, RESIDUAL, TOKENINPUT)}


def family(name: str) -> Family:
    """The family called `name` (refused with the names there are)."""
    if name not in FAMILIES:
        raise FamilyError(f"no translator family {name!r}; there are {', '.join(FAMILIES)}")
    return FAMILIES[name]


def variants() -> list[tuple[Family, Variant]]:
    """Every family's variants, in the order of `FAMILIES` and of each declaration."""
    return [(f, v) for f in FAMILIES.values() for v in f.variants]


def variant(name: str) -> tuple[Family, Variant]:
    """The family and the variant named `name` (refused with the names there are)."""
    for f, v in variants():
        if v.name == name:
            return f, v
    raise FamilyError(f"no translator variant {name!r}; there are {', '.join(v.name for _, v in variants())}")

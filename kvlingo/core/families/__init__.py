"""The translator families. Importing this package registers every one in `FAMILIES` (name → class); each
module declares its family's options and variants (kvlingo.core.translator)."""

from __future__ import annotations

from ..translator import FAMILIES, Translator, TranslatorError, Variant
from . import crosslayer, headwise, residual, tokeninput  # noqa: F401  (each registers its family)


def variants() -> list[tuple[type[Translator], Variant]]:
    """Every family's variants, in the order the families register and declare them."""
    return [(cls, v) for cls in FAMILIES.values() for v in cls.variants]


def variant(name: str) -> tuple[type[Translator], Variant]:
    """The family and the variant named `name` (refused with the names there are)."""
    for cls, v in variants():
        if v.name == name:
            return cls, v
    raise TranslatorError(f"no translator variant {name!r}; there are {', '.join(v.name for _, v in variants())}")

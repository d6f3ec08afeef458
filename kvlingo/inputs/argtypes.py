"""argparse types for the stages' numeric flags: a bad value ends the run at parse time with the
usual `usage: ... error: argument --flag: ...` line (exit status 2), before a model is loaded or
anything is written, instead of a traceback from deep inside a run.

    parser.add_argument("--lengths", type=whole(1), nargs="+")      # 1, 2, ...
    parser.add_argument("--timing-warmups", type=whole(0))          # 0, 1, ...
    parser.add_argument("--cv-limit", type=number(above=0))         # finite and > 0
    parser.add_argument("--max-seconds", type=number(at_least=0))   # finite and ≥ 0
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable


def whole(minimum: int) -> Callable[[str], int]:
    """A whole number ≥ `minimum`."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number; give one ≥ {minimum}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{value} is below {minimum}; give a whole number ≥ {minimum}")
        return value

    parse.__name__ = f"whole number ≥ {minimum}"  # argparse names the type by this when the text is not one
    return parse


def number(above: float | None = None, at_least: float | None = None) -> Callable[[str], float]:
    """A finite number > `above` (or ≥ `at_least`)."""
    if (above is None) == (at_least is None):
        raise ValueError("number() takes exactly one of above= and at_least=")
    bound = f"> {above:g}" if above is not None else f"≥ {at_least:g}"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number; give one {bound}") from None
        if not math.isfinite(value) or (value <= above if above is not None else value < at_least):
            raise argparse.ArgumentTypeError(f"{text} is out of range; give a finite number {bound}")
        return value

    parse.__name__ = f"number {bound}"
    return parse


def share(text: str) -> float:
    """A number in [0, 1] (a weight or a proportion)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number; give one in [0, 1]") from None
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"{text} is out of range; give a number in [0, 1]")
    return value


share.__name__ = "number in [0, 1]"

"""A training's settings (kvlingo/train/config.py): a named family takes its own defaults."""

from __future__ import annotations

from dataclasses import replace

import pytest

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: one torch thread per module


def test_a_named_family_takes_its_own_defaults_not_the_profiles():
    """The demo profile's s2l default before was a rank-32 cross-layer map (a variant of the crosslayer module);
    `--family crosslayer --k 2` must be full-rank, and only a run without --family inherits the variant's."""
    from kvlingo.core.translator import Geometry
    from kvlingo.inputs.profiles import get_profile
    from kvlingo.train.config import resolve_family

    toy = Geometry(4, 2, 32, 4, 2, 32)
    demo = replace(get_profile("demo"), family=("crosshead", "crosslayer-k4-rhalf"))
    assert resolve_family(demo, "s2l", "crosslayer", {"k": 2}, toy) == (
        "crosslayer",
        {"k": 2, "rank": 0, "pairing": "ranked"},
    )
    assert resolve_family(demo, "s2l", None, {"k": 2}, toy) == ("crosslayer", {"k": 2, "rank": 32, "pairing": "ranked"})
    assert resolve_family(demo, "s2l", None, {}, toy) == ("crosslayer", {"k": 4, "rank": 32, "pairing": "ranked"})
    assert resolve_family(demo, "l2s", None, {}, toy) == ("crosshead", {"rank": 0})
    # a rank declared as half the target's width is half of whichever target: 512 of Qwen3's 1,024
    real = Geometry(28, 8, 128, 28, 8, 128)
    assert resolve_family(demo, "s2l", None, {}, real)[1]["rank"] == 512

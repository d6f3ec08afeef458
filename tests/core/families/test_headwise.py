"""Head-wise maps: one batched op against a per-head loop, and another layout refused naming the family that
works."""

from __future__ import annotations

import pytest
import torch

from kvlingo.core.cache import Capture
from kvlingo.core.families.headwise.maps import Headwise
from kvlingo.core.translator import Geometry, TranslatorError


def test_maps_are_one_batched_op_matching_per_head_loop():
    maps = Headwise(Geometry(3, 2, 8, 3, 2, 8))
    with torch.no_grad():
        maps.weight.normal_()
        maps.bias.normal_()
    x = torch.randn(3, 2, 5, 8)
    got = maps.map(1, Capture(x, x, None, torch.empty(0)), slice(None))
    ref = torch.stack(
        [torch.stack([x[l, h] @ maps.weight[1, l, h] + maps.bias[1, l, h] for h in range(2)]) for l in range(3)]
    )
    assert (got - ref).abs().max().item() <= 1e-5


def test_headwise_refuses_another_layout_naming_the_family_that_works():
    with pytest.raises(TranslatorError, match="--family crosslayer"):
        Headwise(Geometry(4, 2, 16, 6, 4, 16))

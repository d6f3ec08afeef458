"""The residual family starts exactly as its base."""

from __future__ import annotations

import pytest
import torch
from refs import fake_capture

from kvlingo.core.cache import Capture
from kvlingo.core.families.headwise.maps import Headwise
from kvlingo.core.families.residual.maps import Residual
from kvlingo.core.translator import Geometry, TranslatorError

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: one torch thread per module


GEOM = Geometry(
    source_layers=4, source_kv_heads=2, source_head_dim=8, target_layers=3, target_kv_heads=3, target_head_dim=4
)


def _capture_for(tr, cap):
    return Capture(cap.prenorm.float(), cap.values.float(), cap.prenorm.float(), cap.logits)


def test_residual_starts_exactly_as_its_base():
    base = Headwise(Geometry(3, 2, 8, 3, 2, 4))
    res = Residual(Geometry(3, 2, 8, 3, 2, 4), base={"family": "headwise", "settings": {}}, hidden=16)
    with torch.no_grad():
        for p in base.parameters():
            p.normal_()
    res.base.load_state_dict(base.state_dict())
    cap = _capture_for(res, fake_capture(res.geometry, 20))
    assert torch.equal(res.map(1, cap, slice(None)), base.map(1, cap, slice(None)))  # keys: on the tiny pair below
    assert res.flops_per_token() > base.flops_per_token()
    with pytest.raises(TranslatorError, match="linear base"):
        Residual(GEOM, base={"family": "residual"})

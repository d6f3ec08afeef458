"""Cross-layer and cross-head maps: the reduced-rank fit is the best low-rank fit, keys take a rank of their
own, and the proportional pairing's plan."""

from __future__ import annotations

import pytest
import torch
from refs import lstsq_blocks

from kvlingo.core.families.crosslayer.maps import CrossHead, CrossLayer, proportional_layers
from kvlingo.core.fit import NormalEquations
from kvlingo.core.translator import Geometry, TranslatorError
from kvlingo.records.saved import load_state

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: one torch thread per module


GEOM = Geometry(
    source_layers=4, source_kv_heads=2, source_head_dim=8, target_layers=3, target_kv_heads=3, target_head_dim=4
)


def test_reduced_rank_is_the_best_low_rank_fit():
    g = torch.Generator().manual_seed(4)
    x = torch.randn(1, 1, 400, 10, generator=g, dtype=torch.float64)
    low = torch.randn(10, 2, generator=g, dtype=torch.float64) @ torch.randn(2, 6, generator=g, dtype=torch.float64)
    y = x @ low + 0.01 * torch.randn(1, 1, 400, 6, generator=g, dtype=torch.float64)
    tr = CrossLayer(Geometry(1, 2, 5, 1, 2, 3), k=1, rank=2, pairing="proportional")
    ne = NormalEquations(1, 1, 10, 6)
    for which in (0, 1):
        ne.update(which, x, y)
    tr.solve_from(ne, 0.0)
    fitted = tr.down[0, 0].double() @ tr.up[0, 0].double()
    assert ((fitted - low).norm() / low.norm()).item() < 2e-3  # the planted rank-2 map is recovered
    assert tr.flops_per_token() == 2.0 * 2 * 1 * 2 * (10 + 6)


def test_a_key_rank_of_its_own_fits_keys_reduced_and_values_in_full(tmp_path):
    """`key_rank`: the keys keep the reduced-rank solution (a planted rank-2 key map is recovered), the values
    the full least-squares one (against lstsq); each counts its own FLOPs and saves under its own names."""
    from kvlingo.records.saved import save_translator

    g = torch.Generator().manual_seed(6)
    x = torch.randn(1, 1, 400, 10, generator=g, dtype=torch.float64)
    low = torch.randn(10, 2, generator=g, dtype=torch.float64) @ torch.randn(2, 6, generator=g, dtype=torch.float64)
    full = torch.randn(10, 6, generator=g, dtype=torch.float64)
    ys = (x @ low + 0.01 * torch.randn(1, 1, 400, 6, generator=g, dtype=torch.float64), x @ full + 0.5)
    tr = CrossLayer(Geometry(1, 2, 5, 1, 2, 3), k=1, rank=0, key_rank=2, pairing="proportional")
    ne = NormalEquations(1, 1, 10, 6)
    for which, y in enumerate(ys):
        ne.update(which, x, y)
    tr.solve_from(ne, 0.0)
    fitted = tr.key_down[0].double() @ tr.key_up[0].double()
    assert ((fitted - low).norm() / low.norm()).item() < 2e-3
    ref = lstsq_blocks(x, ys[1])[0, 0]  # [d_in+1, d_out]
    got = torch.cat([tr.value_weight[0], tr.bias[1][0][None]]).double()
    assert ((got - ref).norm() / ref.norm()).item() < 1e-6
    assert tr.flops_per_token(0) == 2.0 * 2 * (10 + 6) and tr.flops_per_token(1) == 2.0 * 10 * 6
    assert tr.flops_per_token() == tr.flops_per_token(0) + tr.flops_per_token(1)
    assert set(tr.state_dict()) == {"plan", "key_down", "key_up", "value_weight", "bias"}
    # keys and values of one rank keep one stacked tensor per factor, as folders written before key_rank hold
    assert set(CrossHead(GEOM, rank=2).state_dict()) == {"plan", "down", "up", "bias"}
    assert CrossHead(GEOM, rank=2).settings()["key_rank"] == 2 and CrossHead(GEOM, key_rank=3).ranks == (3, 0)
    save_translator(tmp_path / "t", tr, {})
    loaded = load_state(tmp_path / "t")
    assert loaded.ranks == (2, 0) and all(
        torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), tr.state_dict().values())
    )
    with pytest.raises(TranslatorError, match="key rank 7"):
        CrossHead(Geometry(1, 2, 3, 1, 2, 3), key_rank=7)


def test_proportional_pairing_and_crosshead_plan():
    assert [proportional_layers(t, 3, 5) for t in range(3)] == [[0], [2], [4]]
    assert proportional_layers(1, 3, 5, k=3) == [2, 3, 1]
    assert CrossHead(GEOM).plan[0, :, 0].tolist() == [0, 2, 3]  # round(l · 3 / 2): 0, 1.5 → 2, 3
    with pytest.raises(TranslatorError, match="k=5"):
        CrossLayer(GEOM, k=5)

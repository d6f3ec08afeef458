"""The token path's cheaper settings and its deferred values (kvlingo/core/families/tokeninput and
kvlingo/core/handoff.py): the closed form against a planted relation for every part and layer choice, a chunked
translation against the whole, and a handoff under exact:0 written in place, with and without deferred values,
against the assembled one."""

from __future__ import annotations

import pytest
import torch
from tinypair import load_tiny_pair

from kvlingo.core.cache import Capture, build_cache
from kvlingo.core.families.tokeninput.maps import TokenInput
from kvlingo.core.fit import NormalEquations
from kvlingo.core.handoff import capture_source, continue_target, translate, translate_to_cache
from kvlingo.core.settings import Geometry, Part, Refresh

GEOM = Geometry(4, 2, 8, 4, 2, 8)
SETTINGS = [("both", 0), ("values", 0), ("keys", 0), ("both", 2)]


class Table:
    """Token features from a fixed random table (a stand-in for the target's layer 0)."""

    def __init__(self, d: int):
        self.table = torch.randn(50, d, generator=torch.Generator().manual_seed(0), dtype=torch.float64)

    def token_features(self, ids):
        return self.table[ids]


@pytest.mark.parametrize("parts,layers", SETTINGS)
def test_each_token_setting_recovers_a_planted_relation_and_is_priced(parts, layers):
    tr = TokenInput(
        GEOM, base={"family": "headwise", "settings": {}}, rank=0, window=1, token_parts=parts, token_layers=layers
    )
    tr.layer0 = Table(tr.d_tok)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4, 2, 300, 8, generator=g, dtype=torch.float64)
    cap = Capture(x, x, x, torch.empty(0), torch.randint(0, 50, (300,), generator=g))
    L, B, d_in, d_out = tr.fit_blocks()
    design = tr.design(Part.VALUES, cap).double()  # [L, B, T, d_src + d_tok] (keys need a bound key space)
    W = torch.randn(L, B, 8, d_out, generator=g, dtype=torch.float64)
    M = torch.randn(L, B, tr.d_tok, d_out, generator=g, dtype=torch.float64)
    ne, truth = NormalEquations(L, B, d_in, d_out), {}
    for part in (Part.KEYS, Part.VALUES):
        y = design[..., :8] @ W + 0.2
        for layer in range(L):  # a token term only where the family puts one
            if part in tr.tok_parts and layer < tr.n_tok_layers:
                y[layer] += design[layer, ..., 8:] @ M[layer]
        ne.update(part, design, y)
        truth[part] = y
    tr.solve_from(ne, 0.0)
    c32 = Capture(x.float(), x.float(), x.float(), torch.empty(0), cap.ids)
    whole = tr.map(Part.VALUES, c32, slice(None))
    got = tr.block_targets(whole.double())
    assert ((got - truth[Part.VALUES]).norm() / truth[Part.VALUES].norm()).item() < 1e-5
    assert torch.equal(torch.cat([tr.map(Part.VALUES, c32, slice(i, i + 1)) for i in range(4)]), whole)
    per_part = 2.0 * tr.n_tok_layers * tr.d_tok * tr.d_out  # full rank: each part that reads the features
    base = tr.base.flops_per_token(Part.VALUES)
    assert tr.flops_per_token(Part.VALUES) == base + per_part * (Part.VALUES in tr.tok_parts)
    assert tr.flops_per_token() == tr.flops_per_token(Part.KEYS) + tr.flops_per_token(Part.VALUES)


@pytest.mark.parametrize("parts,layers,rank", [("both", 0, 8), ("values", 0, 0), ("both", 1, 8), ("keys", 0, 8)])
def test_exact_layer0_in_place_and_deferred_values_equal_the_assembled_handoff(tiny_pair_paths, parts, layers, rank):
    """Under exact:0 the translator writes layers 1.. and layer 0 is the target's own, in the cache's buffers:
    the new turn's logits equal those on the assembled cache bit for bit; with the values (and the token
    term) deferred, to FP32 rounding."""
    pair = load_tiny_pair(tiny_pair_paths)
    tr = TokenInput(
        Geometry.of(pair.source, pair.target),
        base={"family": "headwise", "settings": {}},
        rank=rank,
        window=2,
        token_parts=parts,
        token_layers=layers,
    )
    torch.manual_seed(0)
    with torch.no_grad():
        for p in tr.parameters():
            p.normal_(0, 0.05)
        tr.base.weight.add_(torch.eye(tr.geometry.source_head_dim, tr.geometry.target_head_dim))
    tr.bind(pair.source, pair.target)
    ids, new = torch.randint(5, 300, (1, 40)), torch.randint(5, 300, (1, 6))
    refresh = Refresh.parse("exact:0")
    cap = capture_source(pair.source, ids, [tr])
    with torch.no_grad():
        assembled = build_cache(
            pair.target, *translate(pair.source, tr, ids, torch.float32, cap, refresh, pair.target), room=8
        )
        want = continue_target(pair.target, assembled, new).logits
        for defer, tolerance in ((False, 0.0), (True, 1e-5)):
            cache = translate_to_cache(
                pair.source, pair.target, tr, ids, cap, room=8, refresh=refresh, defer_values=defer
            )
            assert cache.deferred == defer
            got = continue_target(pair.target, cache, new).logits
            assert float((got - want).abs().max()) <= tolerance, (defer, float((got - want).abs().max()))

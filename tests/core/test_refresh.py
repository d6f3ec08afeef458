"""Refresh settings (kvlingo/core/refresh.py): their two ends against pure translation and the target's own
prefill (bit for bit, FP32), `select` against a token-by-token reference, exact:0 and its cost, and the FLOP
counts against a hand count."""

from __future__ import annotations

import pytest
import torch
from refs import own_cache
from tinypair import load_tiny_pair

from kvlingo.core.cache import build_cache, capture
from kvlingo.core.families.crosslayer.maps import CrossHead
from kvlingo.core.families.headwise.maps import Headwise
from kvlingo.core.handoff import translate
from kvlingo.core.layer0 import flops_per_token
from kvlingo.core.refresh import (
    Refresh,
    RefreshError,
    forward_flops,
    native_prefix_layers,
    refresh_flops,
    refreshed_kv,
    selection_mask,
)
from kvlingo.core.translator import Geometry


@pytest.fixture(scope="module")
def setup(tiny_pair_paths):
    torch.set_num_threads(1)
    pair = load_tiny_pair(tiny_pair_paths)
    tr = Headwise(Geometry.of(pair.source, pair.target)).bind(pair.source, pair.target)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        tr.weight.copy_(torch.eye(16) + 0.3 * torch.randn(tr.weight.shape, generator=g))
        tr.bias.normal_(0, 0.1, generator=g)
    tr.requires_grad_(False)
    ids = torch.randint(10, pair.target.config.vocab_size, (1, 37), generator=g)
    return pair, tr, ids


def ends(pair, tr, ids):
    """The source's capture, pure translation (keys, values) and the target's own capture of ids."""
    with torch.no_grad():
        cap = capture(pair.source, ids, want_prenorm=True, logits_to_keep=1)
        return cap, tr(cap), capture(pair.target, ids, want_prenorm=False, logits_to_keep=1)


def test_parse_and_print():
    assert Refresh.parse(None).kind == "none" and str(Refresh.parse("none")) == "none"
    assert Refresh.parse("tail:64") == Refresh("tail", 64) and str(Refresh.parse("tail:25%")) == "tail:25%"
    assert Refresh.parse("select:0.1") == Refresh.parse("select:10%") == Refresh("select", 0.1)
    assert Refresh.parse("layers:50%").native_layers(28) == 14 and Refresh.parse("tail:10%").tail_tokens(4096) == 410
    for bad in ("tail", "tail:1.5", "select:1.5", "layers:-1", "head:3", "tail:150%"):
        with pytest.raises(RefreshError):
            Refresh.parse(bad)


def test_the_two_ends_are_exact(setup):
    pair, tr, ids = setup
    src, tgt = pair.source, pair.target
    cap, pure, own = ends(pair, tr, ids)
    L, T = tgt.config.num_hidden_layers, ids.shape[1]
    for text in ("tail:0", "layers:0", "select:0", "tail:0%", "none"):
        k, v = refreshed_kv(src, tgt, tr, ids, Refresh.parse(text), cap=cap)
        assert torch.equal(k, pure[0]) and torch.equal(v, pure[1]), text
    for text in (f"tail:{T}", f"layers:{L}", "tail:100%", "layers:100%", "select:1"):
        k, v = refreshed_kv(src, tgt, tr, ids, Refresh.parse(text), cap=cap)
        assert torch.equal(k, own.keys) and torch.equal(v, own.values), text
    # in between: the native part is exactly the target's own, the rest is translated
    k, v = refreshed_kv(src, tgt, tr, ids, Refresh.parse("layers:1"), cap=cap)
    assert torch.equal(k[:1], own.keys[:1]) and torch.equal(k[1:], pure[0][1:])
    k, v = refreshed_kv(src, tgt, tr, ids, Refresh.parse("tail:5"), cap=cap)
    assert torch.equal(k[:, :, : T - 5], pure[0][:, :, : T - 5]) and not torch.equal(k[:, :, -5:], pure[0][:, :, -5:])
    # the handoff path takes the same setting
    kk, _ = translate(src, tr, ids, cap=cap, refresh=Refresh.parse("tail:5"), target=tgt)
    assert torch.equal(kk, k)


def test_layer_diagnostic_swaps_in_one_native_layer(setup):
    pair, tr, ids = setup
    src, tgt = pair.source, pair.target
    cap, pure, own = ends(pair, tr, ids)
    L = tgt.config.num_hidden_layers
    for l in range(L):
        k, v = refreshed_kv(src, tgt, tr, ids, Refresh.parse(f"layer:{l}"), cap=cap)
        others = [i for i in range(L) if i != l]
        assert torch.equal(k[l], own.keys[l]) and torch.equal(v[l], own.values[l]), l
        assert torch.equal(k[others], pure[0][others]) and torch.equal(v[others], pure[1][others]), l
    with pytest.raises(RefreshError, match="layers are 0"):
        refreshed_kv(src, tgt, tr, ids, Refresh.parse(f"layer:{L}"), cap=cap)
    for bad in ("layer:50%", "layer:1.5"):
        with pytest.raises(RefreshError, match="one target layer"):
            Refresh.parse(bad)
    assert str(Refresh.parse("layer:1")) == "layer:1"


def test_native_prefix_layers_stop_early_and_match_the_full_forward(setup):
    pair, _, ids = setup
    with torch.no_grad():
        own = capture(pair.target, ids, want_prenorm=False, logits_to_keep=1)
    k, v = native_prefix_layers(pair.target, ids, 1)
    assert k.shape[0] == 1 and torch.equal(k, own.keys[:1]) and torch.equal(v, own.values[:1])


def test_select_mask_positions_and_logits_against_a_token_by_token_reference(setup):
    pair, tr, ids = setup
    tgt, T = pair.target, ids.shape[1]
    # the mask, against one built by hand
    m = selection_mask([2, 5], [0, 1, 3, 4, 6], "cpu")[0, 0]
    hand = torch.tensor([[1, 1, 0, 0, 0, 1, 0], [1, 1, 1, 1, 0, 1, 1]], dtype=torch.bool)
    assert torch.equal(m, hand)

    refresh = Refresh.parse("select:0.25")
    with torch.no_grad():
        cap = capture(pair.source, ids, want_prenorm=True, logits_to_keep=1)
        pure = tr(cap)
    keys, values = refreshed_kv(pair.source, tgt, tr, ids, refresh, cap=cap)
    refreshed = [t for t in range(T) if not torch.equal(keys[:, :, t], pure[0][:, :, t])]
    assert len(refreshed) == refresh.selected_count(T)
    # The selected tokens are the largest layer-0 deviations from the target's own cache.
    k0, v0 = native_prefix_layers(tgt, ids, 1)
    dev = (k0 - pure[0][:1]).pow(2).sum((0, 1, 3)) + (v0 - pure[1][:1]).pow(2).sum((0, 1, 3))
    assert refreshed == sorted(dev.topk(len(refreshed)).indices.tolist())
    # Reference: each selected token in position order, alone, on a cache of everything before it
    # (translated for the kept tokens, already refreshed for the selected ones), default causal attention.
    ref_k, ref_v = pure[0].clone(), pure[1].clone()
    with torch.no_grad():
        for s in refreshed:
            cache = build_cache(tgt, ref_k[:, :, :s], ref_v[:, :, :s])
            out = tgt(input_ids=ids[:, s : s + 1], cache=cache, use_cache=True)
            ref_k[:, :, s] = torch.stack([layer.keys[0, :, -1] for layer in out.cache.layers])
            ref_v[:, :, s] = torch.stack([layer.values[0, :, -1] for layer in out.cache.layers])
    assert (keys - ref_k).abs().max().item() < 1e-5 and (values - ref_v).abs().max().item() < 1e-5
    # and a new turn on either cache gives the same logits
    new = ids[:, -3:]
    with torch.no_grad():
        a = tgt(input_ids=new, cache=build_cache(tgt, keys, values), use_cache=True).logits
        b = tgt(input_ids=new, cache=build_cache(tgt, ref_k, ref_v), use_cache=True).logits
    assert (a - b).abs().max().item() < 1e-5


def test_flop_counts_match_a_hand_count(setup):
    pair, tr, _ = setup
    c = pair.target.config  # hidden 64, 4 query heads, 2 KV heads, head_dim 16, MLP 128, 2 layers
    per_layer = 64 * 4 * 16 * 2 + 64 * 2 * 16 * 2 + 3 * 64 * 128
    assert forward_flops(c, 10, 20) == 2 * 2 * per_layer * 10 + 4 * 2 * 4 * 16 * 10 * 20
    T, t = 100, tr.flops_per_token()
    none = refresh_flops(Refresh(), pair.source.config, c, t, T)
    assert none["handoff_flops"] == t * T and none["native_flops"] == 0
    tail = refresh_flops(Refresh.parse("tail:10"), pair.source.config, c, t, T)
    assert tail["translate_flops"] == t * 90 and tail["native_flops"] == forward_flops(c, 10, 90 + 5.5)
    full = refresh_flops(Refresh.parse("layers:2"), pair.source.config, c, t, T)
    assert full["translate_flops"] == 0 and full["native_flops"] == forward_flops(c, T, 50.5)
    one = refresh_flops(Refresh.parse("layer:0"), pair.source.config, c, t, T)  # layer 0 native, layer 1 translated
    assert one["translate_flops"] == t * T / 2 and one["native_flops"] == forward_flops(c, T, 50.5, layers=1)
    assert none["fraction_of_reprefill"] < tail["fraction_of_reprefill"] < full["fraction_of_reprefill"] < 1


@pytest.fixture(scope="module")
def pair(tiny_pair_paths, one_thread):
    return load_tiny_pair(tiny_pair_paths)


def test_exact_refresh_swaps_in_layer0_and_leaves_the_translation_elsewhere(pair):
    src, tgt = pair.source, pair.target
    tr = CrossHead(Geometry.of(src, tgt)).bind(src, tgt)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        tr.weight.normal_(0, 0.2, generator=g)
    tr.requires_grad_(False)
    ids = torch.randint(10, tgt.config.vocab_size, (1, 41), generator=g)
    with torch.no_grad():
        cap = capture(src, ids, want_prenorm=True, logits_to_keep=1)
        pure = tr(cap)
    own_k, own_v = own_cache(tgt, ids)[0]
    k, v = refreshed_kv(src, tgt, tr, ids, Refresh.parse("exact:0"), cap=cap)
    assert torch.equal(k[0], own_k) and torch.equal(v[0], own_v)
    assert torch.equal(k[1:], pure[0][1:]) and torch.equal(v[1:], pure[1][1:])
    # the same cache as the diagnostic layer:0, which runs the target's layer-0 forward
    lk, lv = refreshed_kv(src, tgt, tr, ids, Refresh.parse("layer:0"), cap=cap)
    assert torch.equal(k, lk) and torch.equal(v, lv)
    # distillation under exact:0: gradients reach every map but layer 0's (which the setting replaces)
    tr.requires_grad_(True)
    kk, vv = translate(src, tr, ids, cap=cap, refresh=Refresh.parse("exact:0"), target=tgt)
    assert torch.equal(kk.detach(), k) and torch.equal(vv.detach(), v)
    (kk.square().sum() + vv.square().sum()).backward()
    assert tr.weight.grad[:, 0].abs().sum() == 0 and (tr.weight.grad[:, 1:].abs().sum((-1, -2)) > 0).all()


def test_exact_refresh_is_priced_at_one_projection_per_token(pair):
    tgt = pair.target.config
    per_token = 2.0 * tgt.hidden_size * 2 * tgt.num_key_value_heads * tgt.head_dim  # k_proj and v_proj, by hand
    assert flops_per_token(tgt) == per_token
    T, t = 100, 1e6
    L = tgt.num_hidden_layers
    cost = refresh_flops(Refresh.parse("exact:0"), pair.source.config, tgt, t, T)
    assert cost["native_flops"] == per_token * T and cost["translate_flops"] == t * T * (L - 1) / L
    # at the real shapes: about 0.3% of a re-prefill of a 4,096-token context, far below layer:0's forward
    from kvlingo.bench.shapes import real_pair_configs

    for direction in ("l2s", "s2l"):
        s, c = real_pair_configs(direction)
        exact = refresh_flops(Refresh.parse("exact:0"), s, c, 0.0, 4096)
        forward = refresh_flops(Refresh.parse("layer:0"), s, c, 0.0, 4096)
        assert 0.001 < exact["fraction_of_reprefill"] < 0.005 and forward["native_flops"] > 10 * exact["native_flops"]


def test_exact_refresh_parses_layer0_only():
    assert Refresh.parse("exact:0") == Refresh("exact", 0) and str(Refresh.parse("exact:0")) == "exact:0"
    for bad in ("exact:1", "exact:10%", "exact:0.5"):
        with pytest.raises(RefreshError, match="only layer 0"):
            Refresh.parse(bad)


def test_the_layers_a_refresh_makes_the_targets_own():
    """`own_layers`: the target layers no translator output reaches under each setting (what a choice of layers
    leaves out): exact:0 layer 0, layers:K the first K, and none for the settings that recompute tokens or a
    diagnostic layer over a translated rest."""
    own = {text: Refresh.parse(text).own_layers(8) for text in ("none", "exact:0", "layers:3", "layers:25%", "tail:4")}
    assert own == {"none": (), "exact:0": (0,), "layers:3": (0, 1, 2), "layers:25%": (0, 1), "tail:4": ()}
    assert Refresh.parse("select:0.5").own_layers(8) == Refresh.parse("layer:5").own_layers(8) == ()

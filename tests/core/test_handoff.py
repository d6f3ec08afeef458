"""The handoff (kvlingo/core/handoff.py): greedy generation on an injected cache against transformers' generate,
translation straight into the cache, which translators defer their values, and the exact:0 handoff written in
place against the assembled one."""

from __future__ import annotations

import pytest
import torch
from refs import random_ids, random_maps
from tinypair import load_tiny_pair
from translators import random_family, translator

from kvlingo.bench import timing
from kvlingo.core.cache import build_cache, capture, continue_from, run_with_cache
from kvlingo.core.families.crosslayer.maps import CrossHead
from kvlingo.core.families.tokeninput.maps import TokenInput
from kvlingo.core.handoff import (
    can_defer_values,
    capture_source,
    continue_target,
    greedy_generate,
    translate,
    translate_to_cache,
)
from kvlingo.core.refresh import Refresh
from kvlingo.core.translator import Geometry
from kvlingo.inputs.models import ModelSpec, load_model


def native_cache(model, ids):
    cap = capture_source(model, ids)
    return cap.keys, cap.values


def test_greedy_on_injected_cache_equals_transformers_generate(tiny_pair_paths):
    model = load_model(ModelSpec.parse(str(tiny_pair_paths[1])), "cpu", torch.float32)
    ids = torch.randint(10, model.config.vocab_size, (1, 20), generator=torch.Generator().manual_seed(0))
    kv = native_cache(model, ids[0, :-1].tolist())
    ours, hit_cap = greedy_generate(model, ids[0, -1:].tolist(), kv, max_new_tokens=10)
    ref = model.generate(input_ids=ids, max_new_tokens=10, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert hit_cap and ours == ref[0, 20:].tolist()
    # a stop token ends generation and is not returned
    k = max(i for i in range(len(ours)) if ours[i] not in ours[:i])  # last first-occurrence
    stopped, hit = greedy_generate(
        model, ids[0, -1:].tolist(), native_cache(model, ids[0, :-1].tolist()), max_new_tokens=10, eos_ids={ours[k]}
    )
    assert not hit and stopped == ours[:k]


def test_linear_maps_without_a_refresh_on_a_preallocated_cache_defer(translator_pairs):
    source, target, maps = translator(translator_pairs, "headwise")
    cross = CrossHead(Geometry.of(source, target)).bind(source, target)
    residual = random_family("residual", source, target, base={"family": "crosshead", "settings": {}})
    tail = Refresh.parse("tail:4")
    assert can_defer_values(maps, "preallocated") and not can_defer_values(maps, "dynamic")
    assert not can_defer_values(maps, "preallocated", tail) and can_defer_values(cross, "preallocated")
    assert not can_defer_values(residual, "preallocated")  # an MLP on the values is not linear in them
    ids = random_ids(20, target.config.vocab_size)
    with torch.no_grad():
        cap = capture(source, ids, want_prenorm=True)
        with pytest.raises(ValueError, match="residual translator cannot defer values"):
            translate_to_cache(source, target, residual, cap=cap, defer_values=True)
    with pytest.raises(ValueError, match="only translators whose value maps are linear"):
        timing.defer_values_here(residual, "cpu", wanted=True)
    with pytest.raises(ValueError, match="under a refresh"):
        timing.defer_values_here(maps, "cpu", tail, wanted=True)


def test_translation_straight_into_cache_equals_translate_then_build(models):
    source, target = models["large", torch.float32], models["small", torch.float32]
    ids = random_ids(33, target.config.vocab_size, 4)
    maps = random_maps(source, target, 1)
    with torch.no_grad():
        cap = capture(source, ids[:, :28])
        keys, values = maps(cap)
        cache = translate_to_cache(source, target, maps, cap=cap, room=5)
        written = cache.context(28)
        assert torch.equal(written[0], keys) and torch.equal(written[1], values)  # the same bits, in place
        got = run_with_cache(target, ids[:, 28:], cache=cache)[0].logits[0]
        shipped = continue_from(target, keys, values, ids[:, 28:], kind="dynamic").logits[0]
    assert (got - shipped).abs().max().item() <= 1e-5


@pytest.mark.parametrize(
    "parts,layers,rank,choice",
    [("both", 0, 8, "first"), ("values", 0, 0, "first"), ("both", 1, 8, "first"), ("keys", 0, 8, "first")]
    + [("both", 1, 8, "fit"), ("values", 1, 0, "fit"), ("both", 1, 8, "last")],
)
def test_exact_layer0_in_place_and_deferred_values_equal_the_assembled_handoff(
    tiny_pair_paths, parts, layers, rank, choice
):
    """Under exact:0 the translator writes layers 1.. and layer 0 is the target's own, in the cache's buffers:
    the new turn's logits equal those on the assembled cache bit for bit; with the values (and the token
    term) deferred, to FP32 rounding. Chosen layers (token choice fit, or last): the last layer alone reads the
    features."""
    pair = load_tiny_pair(tiny_pair_paths)
    tr = TokenInput(
        Geometry.of(pair.source, pair.target),
        base={"family": "headwise", "settings": {}},
        rank=rank,
        window=2,
        token_parts=parts,
        token_layers=layers,
        token_choice=choice,
    )
    if choice == "fit":
        tr.token_layer_index.fill_(tr.geometry.target_layers - 1)
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

"""Deferred values: a handoff that translates the keys only and lets attention map the source's values.

Checked against the translated cache it replaces (the same maps written as values), transformers'
own path on that cache (DynamicCache, sdpa), and generation token for token."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from kvlingo.core import attention
from kvlingo.core.cache import capture, continue_from, run_with_cache
from kvlingo.core.families.crosslayer import CrossHead
from kvlingo.core.handoff import can_defer_values, greedy_generate, translate_to_cache
from kvlingo.core.preallocated import Deferred
from kvlingo.core.refresh import Refresh
from kvlingo.core.translator import Geometry
from kvlingo.bench import timing
from kvlingo.run.models import ModelSpec, load_model
from test_fastpath import BF16_EPS, random_maps

# BF16: the deferred path rounds in other places than a translated BF16 cache (it never rounds the
# translated values; it rounds the source values' mix before mapping it in FP32). Against FP32 maths on
# the same weights its logits are as far off as the translated cache's: measured 0.021-0.049 for both
# (max |logit| about 2.5) over 4 seeds, at most 1.2× the translated cache's error. Allowed: 1.5× that
# error plus one BF16 rounding of the largest logit.
DEFERRED_BF16_FACTOR = 1.5


def _ids(n: int, vocab: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(10, vocab, (1, n), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def pair(tiny_pair_paths):
    return {dtype: tuple(load_model(ModelSpec.parse(str(path)), "cpu", dtype) for path in tiny_pair_paths)
            for dtype in (torch.float32, torch.bfloat16)}


def translated_and_deferred(source, target, maps, ids, n: int, room: int):
    with torch.no_grad():
        cap = capture(source, ids[:, :n])
        plain = translate_to_cache(source, target, maps, cap=cap, room=room)
        deferred = translate_to_cache(source, target, maps, cap=cap, room=room, defer_values=True)
    return cap, plain, deferred


# --------------------------------------------------------------------------- attention
def _attention_inputs(dtype, q: int, n: int = 11, d_in: int = 12, d_out: int = 16, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    query = torch.randn(1, 6, q, d_out, generator=g).to(dtype)  # 6 query heads over 2 KV heads
    key = torch.randn(1, 2, n + q, d_out, generator=g).to(dtype)
    source_values = torch.randn(1, 2, n, d_in, generator=g).to(dtype)
    own = torch.randn(1, 2, q, d_out, generator=g).to(dtype)
    weight, bias = torch.randn(2, d_in, d_out, generator=g) * 0.3, torch.randn(2, d_out, generator=g)
    mapped = (torch.einsum("htd,hde->hte", source_values[0].float(), weight) + bias[:, None])[None]
    values = torch.cat([mapped.to(dtype), own], dim=2)  # what a translated cache would hold
    return query, key, values, own, Deferred(source_values, weight, bias)


@pytest.mark.parametrize("mask_kind", ["bool", "additive", "context hidden"])
def test_deferred_attention_equals_sdpa_over_the_translated_values(mask_kind, monkeypatch):
    from transformers.masking_utils import sdpa_mask

    query, key, values, own, deferred = _attention_inputs(torch.float32, q=5)
    mask = sdpa_mask(batch_size=1, q_length=5, kv_length=16, q_offset=11, allow_is_causal_skip=False)
    if mask_kind == "additive":
        mask = torch.zeros(mask.shape).masked_fill(~mask, float("-inf"))
    if mask_kind == "context hidden":  # some context tokens masked too: the whole row is masked, not only the turn's
        mask = mask.clone()
        mask[..., 2:5] = False
    repeat = lambda x: x.repeat_interleave(3, dim=1)  # noqa: E731: query head h reads KV head h // 3
    ref = F.scaled_dot_product_attention(query, repeat(key), repeat(values), attn_mask=mask, scale=0.3)
    got = attention.deferred_attention(query, key, own, mask, deferred, scaling=0.3)
    assert got.shape == (1, 5, 6, 16)
    assert (got - ref.transpose(1, 2)).abs().max().item() <= 1e-5
    monkeypatch.setattr(attention, "SCORE_ELEMENTS", 2 * 3 * 16)  # one query row per chunk: the same rows
    assert torch.allclose(attention.deferred_attention(query, key, own, mask, deferred, scaling=0.3), got,
                          atol=1e-6, rtol=0)


def test_deferred_attention_of_one_query_without_a_mask_sees_every_key():
    query, key, values, own, deferred = _attention_inputs(torch.float32, q=1, seed=1)
    repeat = lambda x: x.repeat_interleave(3, dim=1)  # noqa: E731
    ref = F.scaled_dot_product_attention(query, repeat(key), repeat(values))  # default scale 1/sqrt(d)
    got = attention.deferred_attention(query, key, own, None, deferred)
    assert (got - ref.transpose(1, 2)).abs().max().item() <= 1e-5


def test_deferred_attention_refuses_keys_and_values_that_do_not_add_up():
    query, key, _, own, deferred = _attention_inputs(torch.float32, q=3)
    with pytest.raises(ValueError, match="14 keys but 11 deferred and 2 own values"):
        attention.deferred_attention(query, key, own[:, :, :2], None, deferred)


# --------------------------------------------------------------------------- the target on a deferred cache
@pytest.mark.parametrize("n_new", [1, 9, 16])
def test_logits_on_a_deferred_cache_equal_the_translated_cache_and_transformers(pair, n_new):
    source, target = pair[torch.float32]
    maps = random_maps(source, target, 2)
    ids = _ids(40, target.config.vocab_size, 5)
    n = 40 - n_new
    cap, plain, deferred = translated_and_deferred(source, target, maps, ids, n, n_new)
    assert deferred.deferred and not plain.deferred
    assert torch.equal(deferred.context(n)[0], plain.context(n)[0])  # the keys: the same bits
    with torch.no_grad():
        ref = continue_from(target, *maps(cap), ids[:, n:], kind="dynamic").logits[0]  # transformers' own path
        on_plain = run_with_cache(target, ids[:, n:], cache=plain)[0].logits[0]
        on_deferred = run_with_cache(target, ids[:, n:], cache=deferred)[0].logits[0]
    assert (on_deferred - ref).abs().max().item() <= 1e-5
    assert (on_deferred - on_plain).abs().max().item() <= 1e-5
    layer = deferred.layers[0]
    assert layer.offset == n and layer.values.shape[2] == n_new  # the own rows only: the new turn's
    assert layer.deferred.values.data_ptr() == cap.values[0].data_ptr()  # the source's values, not a copy


def test_bf16_deferred_logits_are_as_close_to_fp32_maths_as_the_translated_cache(pair):
    source, target = pair[torch.bfloat16]
    source32, target32 = copy.deepcopy(source).float(), copy.deepcopy(target).float()  # the same weights in FP32
    for seed in range(3):
        maps = random_maps(source, target, seed)
        ids = _ids(60, target.config.vocab_size, seed)
        cap, plain, deferred = translated_and_deferred(source, target, maps, ids, 44, 16)
        with torch.no_grad():
            truth = continue_from(target32, *maps(capture(source32, ids[:, :44]), torch.float32), ids[:, 44:],
                                  kind="dynamic").logits[0]
            on_plain = run_with_cache(target, ids[:, 44:], cache=plain)[0].logits[0].float()
            on_deferred = run_with_cache(target, ids[:, 44:], cache=deferred)[0].logits[0].float()
        plain_error = (on_plain - truth).abs().max().item()
        deferred_error = (on_deferred - truth).abs().max().item()
        assert 0 < deferred_error <= DEFERRED_BF16_FACTOR * plain_error + BF16_EPS * truth.abs().max().item()


def test_greedy_generation_on_a_deferred_cache_equals_dynamic_cache(pair):
    """Generation past the reserved room: the cache grows, and the tokens are transformers' own."""
    source, target = pair[torch.float32]
    maps = random_maps(source, target, 3)
    ids = _ids(26, target.config.vocab_size, 3)
    with torch.no_grad():
        cap = capture(source, ids[:, :-1])
        deferred = translate_to_cache(source, target, maps, cap=cap, room=2, defer_values=True)
        ours, _ = greedy_generate(target, ids[0, -1:].tolist(), cache=deferred, max_new_tokens=14)
        shipped, _ = greedy_generate(target, ids[0, -1:].tolist(), maps(cap), max_new_tokens=14, kind="dynamic")
    assert len(ours) == 14 and ours == shipped
    assert deferred.length == 25 + 14 and deferred.layers[0].capacity >= 39  # grown past its room, values kept


def test_a_reserved_cache_switches_between_deferred_and_translated_values(pair):
    """A cache reused across handoffs (as the timing paths reuse theirs): a translation without deferral
    after a deferred one fills the values again, and the other way round."""
    source, target = pair[torch.float32]
    maps = random_maps(source, target, 4)
    ids = _ids(36, target.config.vocab_size, 4)
    with torch.no_grad():
        cap = capture(source, ids[:, :30])
        ref = continue_from(target, *maps(cap), ids[:, 30:], kind="dynamic").logits[0]
        cache = translate_to_cache(source, target, maps, cap=cap, room=6, defer_values=True)
        for defer in (False, True, False):
            translate_to_cache(source, target, maps, cap=cap, into=cache, defer_values=defer)
            assert cache.deferred == defer and cache.length == 30
            got = run_with_cache(target, ids[:, 30:], cache=cache)[0].logits[0]
            assert (got - ref).abs().max().item() <= 1e-5
            cache.set_length(30)
        with pytest.raises(ValueError, match="deferred"):
            translate_to_cache(source, target, maps, cap=cap, into=cache, defer_values=True)
            cache.crop(-5)  # below the deferred context: refused, the context cannot be cut


def test_only_headwise_maps_without_a_refresh_on_a_preallocated_cache_defer(pair):
    source, target = pair[torch.float32]
    maps = random_maps(source, target)
    cross = CrossHead(Geometry.of(source, target)).bind(source, target)
    tail = Refresh.parse("tail:4")
    assert can_defer_values(maps, "preallocated") and not can_defer_values(maps, "dynamic")
    assert not can_defer_values(maps, "preallocated", tail) and not can_defer_values(cross, "preallocated")
    ids = _ids(20, target.config.vocab_size)
    with torch.no_grad():
        cap = capture(source, ids, want_prenorm=True)
        with pytest.raises(ValueError, match="crosshead translator cannot defer values"):
            translate_to_cache(source, target, cross, cap=cap, defer_values=True)
    # the timing paths: on by default on a CPU where the maps can, refused where asked for and impossible
    assert timing.defer_values_here(maps, "cpu") and not timing.defer_values_here(maps, "cuda")
    assert timing.defer_values_here(maps, "cuda", wanted=True) and not timing.defer_values_here(maps, "cpu", wanted=False)
    assert not timing.defer_values_here(cross, "cpu")
    with pytest.raises(ValueError, match="only head-wise maps without a refresh"):
        timing.defer_values_here(maps, "cpu", tail, wanted=True)


def test_a_deferred_cache_refuses_maps_of_the_wrong_shape(pair):
    source, target = pair[torch.float32]
    maps = random_maps(source, target)
    ids = _ids(20, target.config.vocab_size)
    with torch.no_grad():
        cache = translate_to_cache(source, target, maps, cap=capture(source, ids))
    weight, bias = maps.value_maps()
    values = torch.zeros(weight.shape[0], weight.shape[1], 20, weight.shape[2])
    with pytest.raises(ValueError, match="must be"):
        cache.defer_values(values, weight[:, :1], bias)
    with pytest.raises(ValueError, match="exceed the capacity"):
        cache.defer_values(torch.zeros(*values.shape[:2], 21, values.shape[3]), weight, bias)
    assert not cache.deferred and cache.length == 20  # a refused deferral changes nothing


def test_timing_paths_defer_on_a_cpu_and_agree_with_transformers(pair):
    source, target = pair[torch.float32]
    maps = random_maps(source, target, 6)
    ids = _ids(30, target.config.vocab_size, 6)
    with torch.no_grad():
        handed = continue_from(target, *maps(capture(source, ids[:, :26])), ids[:, 26:], kind="dynamic").logits[0, -1]
        native = target(input_ids=ids).logits[0, -1]
    with torch.inference_mode():
        on = timing.HandoffPaths(source, target, maps, ids[:, :26], ids[:, 26:], timing.PathOptions("optimised"))
        off = timing.HandoffPaths(source, target, maps, ids[:, :26], ids[:, 26:],
                                  timing.PathOptions("optimised", defer_values=False))
        shipped = timing.HandoffPaths(source, target, maps, ids[:, :26], ids[:, 26:],
                                      timing.PathOptions("shipped", defer_values=True))
        assert on.defer_values and not off.defer_values and not shipped.defer_values  # shipped: never
        for paths in (on, off):
            for name in timing.PATHS:
                ref = handed if "handoff" in name else native
                assert (paths.path(name)() - ref).abs().max().item() <= 1e-5, name
            assert torch.equal(paths.source_cache_handoff(), paths.source_cache_handoff())  # a reused cache
        assert on.handoff_cache.deferred and not off.handoff_cache.deferred

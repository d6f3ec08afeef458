"""Deferred values: a handoff that translates the keys only and lets attention map the source's values.

Every family whose value maps are linear in the source's values defers: head-wise maps (head j reads
head j), cross-head maps (every source head), cross-layer maps (every head of k source layers) and
their low-rank forms. Each is checked against the translated cache it replaces (the same maps written
as values), transformers' own path on that cache (DynamicCache, sdpa), and generation token for token,
on the tiny pair and on a pair of other depths, KV-head counts and head_dim."""

from __future__ import annotations

import copy
from dataclasses import asdict

import pytest
import torch
import torch.nn.functional as F
from test_fastpath import BF16_EPS, random_maps
from tinypair import tiny_model

from kvlingo.bench import timing
from kvlingo.core import attention
from kvlingo.core.cache import capture, continue_from, run_with_cache
from kvlingo.core.families.crosslayer.maps import CrossHead
from kvlingo.core.handoff import can_defer_values, greedy_generate, translate_to_cache
from kvlingo.core.preallocated import Deferred, ValueMaps
from kvlingo.core.refresh import Refresh
from kvlingo.core.translator import Geometry
from kvlingo.inputs.models import ModelSpec, load_model
from kvlingo.records.saved import build

# BF16: the deferred path rounds in other places than a translated BF16 cache (it never rounds the
# translated values; it rounds each source value's mix before mapping it in FP32). Against FP32 maths on
# the same weights its logits are as far off as the translated cache's: over 4 seeds of each translator
# below, both errors 0.012-0.049 (max |logit| 1.9-3.1), the deferred one 0.81-1.41× the translated
# cache's (head-wise up to 1.41×, cross-head 1.29×, cross-layer 1.38×). Allowed: 1.5× that error plus
# one BF16 rounding of the largest logit.
DEFERRED_BF16_FACTOR = 1.5

# The translators: (name, pair, family, settings). "tiny" is the tiny pair (2 layers × 2 KV heads × 16
# both sides); "other" a 3-layer source with 1 KV head × 32 into the tiny 2-layer target (2 × 16).
TRANSLATORS = [
    ("headwise", "tiny", "headwise", {}),
    ("crosshead", "tiny", "crosshead", {}),
    ("crosshead key rank 8", "tiny", "crosshead", {"key_rank": 8}),
    ("crosshead other", "other", "crosshead", {}),
    ("crosslayer k=2", "other", "crosslayer", {"k": 2, "pairing": "proportional"}),
    ("crosslayer k=2 rank 12", "other", "crosslayer", {"k": 2, "rank": 12, "pairing": "proportional"}),
    (
        "crosslayer k=2 rank 12, key rank 6",
        "other",
        "crosslayer",
        {"k": 2, "rank": 12, "key_rank": 6, "pairing": "proportional"},
    ),
]
NAMES = [t[0] for t in TRANSLATORS]


def _ids(n: int, vocab: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(10, vocab, (1, n), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def pair(tiny_pair_paths):
    return {
        dtype: tuple(load_model(ModelSpec.parse(str(path)), "cpu", dtype) for path in tiny_pair_paths)
        for dtype in (torch.float32, torch.bfloat16)
    }


@pytest.fixture(scope="module")
def pairs(pair):
    """{(pair name, dtype): (source, target)}: the tiny pair, and a source of another geometry into its target."""
    other = tiny_model(
        "qwen3",
        layers=3,
        kv_heads=1,
        head_dim=32,
        heads=4,
        hidden=64,
        seed=7,
        vocab=pair[torch.float32][1].config.vocab_size,
    )
    out = {("tiny", dtype): models for dtype, models in pair.items()}
    for dtype in (torch.float32, torch.bfloat16):
        out["other", dtype] = (copy.deepcopy(other).to(dtype), pair[dtype][1])
    return out


def random_family(family: str, source, target, seed: int = 0, **settings):
    """Random maps of a family, bound to the pair: weights N(0, 1/fan-in) (N(0, 0.3) head-wise), biases N(0, 0.1)."""
    if family == "headwise":
        return random_maps(source, target, seed)
    maps = build(
        {
            "family": family,
            "key_space": "prenorm",
            "settings": settings,
            "geometry": asdict(Geometry.of(source, target)),
        }
    )
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in maps.parameters():
            p.normal_(0.0, p.shape[-2] ** -0.5 if p.dim() >= 3 else 0.1, generator=g)
    return maps.bind(source, target).requires_grad_(False)


def translator(pairs, name: str, dtype=torch.float32, seed: int = 0):
    _, which, family, settings = TRANSLATORS[NAMES.index(name)]
    source, target = pairs[which, dtype]
    return source, target, random_family(family, source, target, seed, **settings)


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
    source_values = torch.randn(2, n, d_in, generator=g).to(dtype)
    own = torch.randn(1, 2, q, d_out, generator=g).to(dtype)
    weight, bias = torch.randn(2, d_in, d_out, generator=g) * 0.3, torch.randn(2, d_out, generator=g)
    mapped = (torch.einsum("htd,hde->hte", source_values.float(), weight) + bias[:, None])[None]
    values = torch.cat([mapped.to(dtype), own], dim=2)  # what a translated cache would hold
    return query, key, values, own, Deferred((source_values,), True, weight, bias)


def _mixing_inputs(
    q: int, n: int = 11, source_heads: int = 3, d_s: int = 8, d_out: int = 16, rank: int = 0, seed: int = 0
):
    """Two source layers of 3 heads feeding 2 target heads; the translated values written out head by head."""
    g = torch.Generator().manual_seed(seed)
    query = torch.randn(1, 6, q, d_out, generator=g)
    key = torch.randn(1, 2, n + q, d_out, generator=g)
    layers = [torch.randn(source_heads, n, d_s, generator=g) for _ in range(2)]
    own = torch.randn(1, 2, q, d_out, generator=g)
    mix = 2 * source_heads * d_s
    down = torch.randn(mix, rank, generator=g) * 0.3 if rank else None
    weight, bias = torch.randn(2, rank or mix, d_out, generator=g) * 0.3, torch.randn(2, d_out, generator=g)
    full = weight if down is None else torch.einsum("ir,jro->jio", down, weight)  # [2, mix, d_out]
    mapped = bias[:, None].repeat(1, n, 1)  # [2 target heads, n, d_out]
    for j in range(2):
        for i, v in enumerate(layers):  # the (layer, head, dim) order of the mix
            for h in range(source_heads):
                rows = slice((i * source_heads + h) * d_s, (i * source_heads + h + 1) * d_s)
                mapped[j] += v[h] @ full[j, rows]
    values = torch.cat([mapped[None], own], dim=2)
    return query, key, values, own, Deferred(tuple(layers), False, weight, bias, down)


@pytest.mark.parametrize("mask_kind", ["bool", "additive", "context hidden"])
@pytest.mark.parametrize("maps", ["per head", "every head of two layers", "low rank"])
def test_deferred_attention_equals_sdpa_over_the_translated_values(mask_kind, maps, monkeypatch):
    from transformers.masking_utils import sdpa_mask

    if maps == "per head":
        query, key, values, own, deferred = _attention_inputs(torch.float32, q=5)
    else:
        query, key, values, own, deferred = _mixing_inputs(q=5, rank=5 if maps == "low rank" else 0)
    mask = sdpa_mask(batch_size=1, q_length=5, kv_length=16, q_offset=11, allow_is_causal_skip=False)
    if mask_kind == "additive":
        mask = torch.zeros(mask.shape).masked_fill(~mask, float("-inf"))
    if mask_kind == "context hidden":  # some context tokens masked too: the whole row is masked, not only the turn's
        mask = mask.clone()
        mask[..., 2:5] = False
    repeat = lambda x: x.repeat_interleave(3, dim=1)  # noqa: E731  (query head h reads KV head h // 3)
    ref = F.scaled_dot_product_attention(query, repeat(key), repeat(values), attn_mask=mask, scale=0.3)
    got = attention.deferred_attention(query, key, own, mask, deferred, scaling=0.3)
    assert got.shape == (1, 5, 6, 16)
    assert (got - ref.transpose(1, 2)).abs().max().item() <= 1e-5
    monkeypatch.setattr(attention, "SCORE_ELEMENTS", 2 * 3 * 16)  # one query row per chunk: the same rows
    assert torch.allclose(
        attention.deferred_attention(query, key, own, mask, deferred, scaling=0.3), got, atol=1e-6, rtol=0
    )


def test_deferred_attention_of_one_query_without_a_mask_sees_every_key():
    for query, key, values, own, deferred in (
        _attention_inputs(torch.float32, q=1, seed=1),
        _mixing_inputs(q=1, rank=4, seed=1),
    ):
        repeat = lambda x: x.repeat_interleave(3, dim=1)  # noqa: E731
        ref = F.scaled_dot_product_attention(query, repeat(key), repeat(values))  # default scale 1/sqrt(d)
        got = attention.deferred_attention(query, key, own, None, deferred)
        assert (got - ref.transpose(1, 2)).abs().max().item() <= 1e-5


def test_deferred_attention_refuses_keys_and_values_that_do_not_add_up():
    query, key, _, own, deferred = _attention_inputs(torch.float32, q=3)
    with pytest.raises(ValueError, match="14 keys but 11 deferred and 2 own values"):
        attention.deferred_attention(query, key, own[:, :, :2], None, deferred)


# --------------------------------------------------------------------------- the target on a deferred cache
@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("n_new", [1, 9, 16])
def test_logits_on_a_deferred_cache_equal_the_translated_cache_and_transformers(pairs, name, n_new):
    source, target, maps = translator(pairs, name, seed=1)
    assert can_defer_values(maps)
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
    plan = maps.value_maps().layers
    for i, layer in enumerate(deferred.layers):
        assert layer.offset == n and layer.values.shape[2] == n_new  # the own rows only: the new turn's
        # the source's values of the layers this layer reads, as views of the capture, not copies
        assert [v.data_ptr() for v in layer.deferred.sources] == [cap.values[s].data_ptr() for s in plan[i]]


@pytest.mark.parametrize("name", NAMES)
def test_bf16_deferred_logits_are_as_close_to_fp32_maths_as_the_translated_cache(pairs, name):
    for seed in range(3):
        source, target, maps = translator(pairs, name, torch.bfloat16, seed)
        source32, target32 = copy.deepcopy(source).float(), copy.deepcopy(target).float()  # the same weights in FP32
        ids = _ids(60, target.config.vocab_size, seed)
        cap, plain, deferred = translated_and_deferred(source, target, maps, ids, 44, 16)
        with torch.no_grad():
            truth = continue_from(
                target32, *maps(capture(source32, ids[:, :44]), torch.float32), ids[:, 44:], kind="dynamic"
            ).logits[0]
            on_plain = run_with_cache(target, ids[:, 44:], cache=plain)[0].logits[0].float()
            on_deferred = run_with_cache(target, ids[:, 44:], cache=deferred)[0].logits[0].float()
        plain_error = (on_plain - truth).abs().max().item()
        deferred_error = (on_deferred - truth).abs().max().item()
        assert 0 < deferred_error <= DEFERRED_BF16_FACTOR * plain_error + BF16_EPS * truth.abs().max().item()


@pytest.mark.parametrize("name", NAMES)
def test_greedy_generation_on_a_deferred_cache_equals_dynamic_cache(pairs, name):
    """Generation past the reserved room: the cache grows, and the tokens are transformers' own."""
    source, target, maps = translator(pairs, name, seed=3)
    ids = _ids(26, target.config.vocab_size, 3)
    with torch.no_grad():
        cap = capture(source, ids[:, :-1])
        deferred = translate_to_cache(source, target, maps, cap=cap, room=2, defer_values=True)
        ours, _ = greedy_generate(target, ids[0, -1:].tolist(), cache=deferred, max_new_tokens=14)
        shipped, _ = greedy_generate(target, ids[0, -1:].tolist(), maps(cap), max_new_tokens=14, kind="dynamic")
    assert len(ours) == 14 and ours == shipped
    assert deferred.length == 25 + 14 and deferred.layers[0].capacity >= 39  # grown past its room, values kept


def test_a_reserved_cache_switches_between_deferred_and_translated_values(pairs):
    """A cache reused across handoffs (as the timing paths reuse theirs): a translation without deferral
    after a deferred one fills the values again, and the other way round."""
    source, target, maps = translator(pairs, "crosslayer k=2 rank 12", seed=4)
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


def test_linear_maps_without_a_refresh_on_a_preallocated_cache_defer(pairs):
    source, target, maps = translator(pairs, "headwise")
    cross = CrossHead(Geometry.of(source, target)).bind(source, target)
    residual = random_family("residual", source, target, base={"family": "crosshead", "settings": {}})
    tail = Refresh.parse("tail:4")
    assert can_defer_values(maps, "preallocated") and not can_defer_values(maps, "dynamic")
    assert not can_defer_values(maps, "preallocated", tail) and can_defer_values(cross, "preallocated")
    assert not can_defer_values(residual, "preallocated")  # an MLP on the values is not linear in them
    ids = _ids(20, target.config.vocab_size)
    with torch.no_grad():
        cap = capture(source, ids, want_prenorm=True)
        with pytest.raises(ValueError, match="residual translator cannot defer values"):
            translate_to_cache(source, target, residual, cap=cap, defer_values=True)
    with pytest.raises(ValueError, match="only translators whose value maps are linear"):
        timing.defer_values_here(residual, "cpu", wanted=True)
    with pytest.raises(ValueError, match="under a refresh"):
        timing.defer_values_here(maps, "cpu", tail, wanted=True)


def test_a_deferred_cache_refuses_maps_of_the_wrong_shape(pairs):
    source, target, maps = translator(pairs, "crosslayer k=2 rank 12")
    ids = _ids(20, target.config.vocab_size)
    with torch.no_grad():
        cache = translate_to_cache(source, target, maps, cap=capture(source, ids))
    vm = maps.value_maps()
    values = torch.zeros(3, 1, 20, 32)  # the source's: 3 layers × 1 KV head × 32
    for wrong, message in (
        (ValueMaps(vm.layers, vm.per_head, vm.weight[:, :1], vm.bias, vm.down), "are not"),
        (ValueMaps(vm.layers, vm.per_head, vm.weight, vm.bias, vm.down[:, :5]), "down"),
        (ValueMaps(vm.layers, True, vm.weight, vm.bias, vm.down), "per-head maps need 2"),
        (ValueMaps(((0, 1), (3, 1)), False, vm.weight, vm.bias, vm.down), "below 3"),
    ):
        with pytest.raises(ValueError, match=message):
            cache.defer_values(values, wrong)
    with pytest.raises(ValueError, match="exceed the capacity"):
        cache.defer_values(torch.zeros(3, 1, 21, 32), vm)
    assert not cache.deferred and cache.length == 20  # a refused deferral changes nothing
    cache.defer_values(values, vm)
    assert cache.deferred and cache.length == 20


def test_value_maps_are_the_families_own_value_maps(pairs):
    """`value_maps` of a cross-layer translator reproduce its value map (`map(1, ...)`) from the capture."""
    for name in ("crosshead other", "crosslayer k=2", "crosslayer k=2 rank 12, key rank 6"):
        source, target, maps = translator(pairs, name, seed=2)
        ids = _ids(12, target.config.vocab_size)
        with torch.no_grad():
            cap = capture(source, ids)
            ref = maps.map(1, cap, slice(None))  # [L_t, H_t, T, d_t]
        vm = maps.value_maps()
        for layer, reads in enumerate(vm.layers):
            x = torch.cat([cap.values[s].transpose(0, 1).reshape(12, -1) for s in reads], dim=-1)  # [T, mix]
            if vm.down is not None:
                x = x @ vm.down[layer]
            got = torch.einsum("ti,hio->hto", x, vm.weight[layer]) + vm.bias[layer][:, None]
            assert (got - ref[layer]).abs().max().item() <= 1e-5, name


def test_timing_paths_defer_on_a_cpu_where_cheaper_and_agree_with_transformers(pairs):
    for name in ("headwise", "crosslayer k=2 rank 12"):
        source, target, maps = translator(pairs, name, seed=6)
        ids = _ids(30, target.config.vocab_size, 6)
        with torch.no_grad():
            handed = continue_from(target, *maps(capture(source, ids[:, :26])), ids[:, 26:], kind="dynamic").logits[
                0, -1
            ]
            native = target(input_ids=ids).logits[0, -1]
        with torch.inference_mode():
            on = timing.HandoffPaths(
                source, target, maps, ids[:, :26], ids[:, 26:], timing.PathOptions("optimised", defer_values=True)
            )
            off = timing.HandoffPaths(
                source, target, maps, ids[:, :26], ids[:, 26:], timing.PathOptions("optimised", defer_values=False)
            )
            shipped = timing.HandoffPaths(
                source, target, maps, ids[:, :26], ids[:, 26:], timing.PathOptions("shipped", defer_values=True)
            )
            assert on.defer_values and not off.defer_values and not shipped.defer_values  # shipped: never
            for paths in (on, off):
                for path in timing.PATHS:
                    ref = handed if "handoff" in path else native
                    assert (paths.path(path)() - ref).abs().max().item() <= 1e-5, (name, path)
                assert torch.equal(paths.source_cache_handoff(), paths.source_cache_handoff())  # a reused cache
            assert on.handoff_cache.deferred and not off.handoff_cache.deferred


# --------------------------------------------------------------------------- what deferral costs
@pytest.mark.parametrize("name", ["headwise", "crosshead", "crosslayer k=2 rank 12, key rank 6"])
def test_deferred_work_is_what_the_new_turn_adds_by_torch_flop_counter(pairs, name):
    """`roofline.deferred_work`'s FLOPs equal torch's count of a new turn on the deferred cache minus the same
    turn on the translated cache; `handoff_work` then prices the keys-only translation plus that turn."""
    from torch.utils.flop_counter import FlopCounterMode

    from kvlingo.bench.roofline import deferred_work, handoff_work

    source, target, maps = translator(pairs, name, seed=8)
    ids = _ids(39, target.config.vocab_size, 8)
    _, plain, deferred = translated_and_deferred(source, target, maps, ids, 30, 9)
    counts = []
    for cache in (plain, deferred):
        with torch.no_grad(), FlopCounterMode(display=False) as counter:
            run_with_cache(target, ids[:, 30:], cache=cache)
        counts.append(counter.get_total_flops())
    flops, _ = deferred_work(maps, target, 30, 9, torch.float32)
    assert flops == counts[1] - counts[0] != 0
    on, off = (handoff_work(source, target, maps, 30, 9, torch.float32, defer_values=d) for d in (True, False))
    assert on["translation"][0] == maps.flops_per_token(0) * 30 and off["translation"][0] == maps.flops_per_token() * 30
    assert on["new_turn"][0] - off["new_turn"][0] == flops and on["reprefill"] == off["reprefill"]


def test_timing_defers_by_default_on_a_cpu_only_where_it_saves_flops(pairs):
    """Translating a cross-head map's values costs 2·mix·d_out per context token; deferring them costs each of
    the turn's q_heads·k query rows 2·(mix − d_t) per context token: on the tiny pair that saves FLOPs for
    a 1-token turn, not for a 16-token one. Head-wise deferral adds only the per-row maps (mix = d_t): it
    saves FLOPs on any but the shortest contexts (here from 33 tokens on, for a 16-token turn)."""
    from kvlingo.bench.roofline import deferral_saves

    source, target, headwise = translator(pairs, "headwise")
    cross = translator(pairs, "crosshead")[2]
    assert not deferral_saves(headwise, target, 32, 16) and deferral_saves(headwise, target, 33, 16)
    assert timing.defer_values_here(headwise, "cpu", target=target)  # 4,096 tokens by default
    assert not timing.defer_values_here(headwise, "cuda", target=target)  # untimed there: asked for with True
    assert timing.defer_values_here(headwise, "cuda", wanted=True)
    assert timing.defer_values_here(cross, "cpu", target=target, n=30, k=1)
    assert not timing.defer_values_here(cross, "cpu", target=target, n=30, k=16)
    assert timing.defer_values_here(cross, "cpu", wanted=True)  # asked for: deferred even where it costs more


# --------------------------------------------------------------------------- on a GPU (skipped elsewhere)
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("name", ["headwise", "crosshead", "crosslayer k=2 rank 12, key rank 6"])
def test_deferred_values_on_cuda_replay_as_cuda_graphs_and_stay_as_close_as_translated(pairs, name):
    """BF16 on CUDA, the optimised paths with the values deferred: replayed as CUDA graphs they give the eager
    paths' logits bit for bit (the deferred attention reads no mask there); the handoff's logits are as close to
    FP32 maths as those of the same paths with the values translated (`DEFERRED_BF16_FACTOR`)."""
    source32, target32, maps32 = translator(pairs, name, torch.float32, seed=9)
    source, target = (copy.deepcopy(m).to("cuda", torch.bfloat16) for m in (source32, target32))
    maps = copy.deepcopy(maps32).cuda().bind(source, target)
    ids = _ids(60, target.config.vocab_size, 9)
    with torch.no_grad():
        truth = continue_from(target32, *maps32(capture(source32, ids[:, :52])), ids[:, 52:], kind="dynamic").logits[
            0, -1
        ]
    ids = ids.cuda()
    paths = {
        (defer, graphs): timing.HandoffPaths(
            source, target, maps, ids[:, :52], ids[:, 52:], timing.PathOptions(defer_values=defer, cuda_graphs=graphs)
        )
        for defer in (True, False)
        for graphs in (True, False)
    }
    graphed = paths[True, True]
    assert graphed.defer_values and not graphed.graph_errors and {"translate", "new_turn"} <= set(graphed.graphed)
    with torch.inference_mode():
        for path in timing.PATHS:
            a, b = graphed.path(path)().clone(), graphed.path(path)().clone()
            assert torch.equal(a, b) and torch.equal(a, paths[True, False].path(path)()), path
        deferred = (graphed.source_cache_handoff().float().cpu() - truth).abs().max().item()
        translated = (paths[False, True].source_cache_handoff().float().cpu() - truth).abs().max().item()
    assert deferred <= DEFERRED_BF16_FACTOR * translated + BF16_EPS * truth.abs().max().item()


@pytest.mark.gpu
@needs_cuda
def test_perf_times_deferred_values_on_cuda(tmp_path):
    """perf.py on CUDA with deferred values asked for, on the 2-layer stand-in: the default family's optimised
    rows defer, replay as CUDA graphs with no capture failing, and the limit counts the deferred work."""
    import json

    import perf

    perf.main(
        [
            "--arch",
            "tiny",
            "--device",
            "cuda",
            "--lengths",
            "64",
            "--new-turn-tokens",
            "4",
            "--modes",
            "optimised",
            "--defer-values",
            "on",
            "--timing-warmups",
            "1",
            "--timing-repeats",
            "3",
            "--allow-cv",
            "--results",
            str(tmp_path),
        ]
    )
    point = json.loads((tmp_path / "perf" / "perf.json").read_text())["results"]["lengths"][0]
    row = point["modes"]["optimised"]
    assert row["deferred_values"] and not row["graph_errors"] and "new_turn" in row["cuda_graphs"]
    assert point["cost"]["deferred"] and point["cost"]["deferred_new_turn_flops"] > 0

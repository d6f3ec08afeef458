"""The chunked translation engine (kvlingo/core/engine.py): chunks and token tiles give the per-head reference's
bits, and the BF16 fast path stays within its tolerance of FP32 maths."""

from __future__ import annotations

import pytest
import torch
from refs import random_ids, random_maps

from kvlingo.core import engine
from kvlingo.core.cache import capture, empty_cache
from kvlingo.core.engine import FAST_BF16_TOLERANCE
from kvlingo.core.families.headwise.maps import Headwise
from kvlingo.core.rope import apply_rope, rope_tables, strip_rope
from kvlingo.core.translator import Geometry


@pytest.mark.parametrize("key_space", ["prenorm", "cache"])
def test_token_tiles_of_norm_and_rope_give_the_same_bits(models, monkeypatch, key_space):
    from kvlingo.core import engine

    source, target = models["large", torch.float32], models["small", torch.float32]
    maps = Headwise(Geometry.of(source, target), key_space).bind(source, target)
    maps.load_state_dict(random_maps(source, target, 5).state_dict())
    with torch.no_grad():
        cap = capture(source, random_ids(23, target.config.vocab_size, 11))
        whole = [maps(cap, dtype, chunk_elements=1) for dtype in (torch.float32, torch.bfloat16)]
        per_token = target.config.num_key_value_heads * target.config.head_dim
        monkeypatch.setitem(engine.TILE_ELEMENTS, "cpu", 5 * per_token)  # 5-token tiles, the last one of 3
        assert engine.chunk_tokens(maps, 23, "cpu") == 5
        tiled = [maps(cap, dtype, chunk_elements=1) for dtype in (torch.float32, torch.bfloat16)]
    for a, b in zip(whole, tiled):
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_bf16_fast_translation_within_tolerance_of_fp32_maths(models):
    source, target = models["large", torch.bfloat16], models["small", torch.bfloat16]
    ids = random_ids(40, target.config.vocab_size, 5)
    for key_space in ("prenorm", "cache"):
        maps = Headwise(Geometry.of(source, target), key_space).bind(source, target)
        with torch.no_grad():
            maps.weight.copy_(
                torch.eye(16) + 0.2 * torch.randn(maps.weight.shape, generator=torch.Generator().manual_seed(6))
            )
            maps.bias.normal_(0, 0.1, generator=torch.Generator().manual_seed(7))
            cap = capture(source, ids)
            exact = maps(cap, torch.bfloat16, precision="fp32")
            cache = empty_cache(target, ids.shape[1], 3, torch.bfloat16)
            fast = maps(cap, precision="fast", out=cache.context(ids.shape[1]))
        for ref, got in zip(exact, fast):
            assert got.dtype == torch.bfloat16
            assert not torch.equal(ref, got)  # the BF16 matmuls really ran
            for layer in range(ref.shape[0]):
                bound = FAST_BF16_TOLERANCE * ref[layer].float().abs().max().item()
                assert (got[layer].float() - ref[layer].float()).abs().max().item() <= bound
    assert (
        engine.compute_dtype(maps, torch.float32, "fast") == torch.float32
    )  # FP32 runs keep FP32 inputs (TF32 on CUDA)


@pytest.mark.parametrize("settings", [{"k": 1, "pairing": "proportional"}, {"k": 2, "rank": 8}])
def test_bf16_fast_crosslayer_within_tolerance_of_fp32_maths(models, settings):
    """The default families (cross-head, cross-layer at a rank) take the fast path too: within the same bound."""
    from kvlingo.core.families.crosslayer.maps import CrossLayer

    source, target = models["large", torch.bfloat16], models["small", torch.bfloat16]
    ids = random_ids(40, target.config.vocab_size, 5)
    maps = CrossLayer(Geometry.of(source, target), **settings).bind(source, target)
    gen = torch.Generator().manual_seed(8)
    with torch.no_grad():
        for p in maps.parameters():
            p.copy_(0.2 * torch.randn(p.shape, generator=gen))
        cap = capture(source, ids)
        exact = maps(cap, torch.bfloat16, precision="fp32")
        cache = empty_cache(target, ids.shape[1], 3, torch.bfloat16)
        fast = maps(cap, precision="fast", out=cache.context(ids.shape[1]))
    assert engine.compute_dtype(maps, torch.bfloat16, "fast") == torch.bfloat16
    for ref, got in zip(exact, fast):
        assert got.dtype == torch.bfloat16 and not torch.equal(ref, got)  # the BF16 matmuls really ran
        for layer in range(ref.shape[0]):
            bound = FAST_BF16_TOLERANCE * ref[layer].float().abs().max().item()
            assert (got[layer].float() - ref[layer].float()).abs().max().item() <= bound


def test_family_without_fast_paths_keeps_fp32_maths_and_contiguous_scratch(models):
    source, target = models["large", torch.float32], models["small", torch.float32]

    class Plain(Headwise):  # a family that has not opted in: the base must not hand it strided outputs
        fast_paths = False

        def map_into(self, which, cap, layers, out):
            assert out.is_contiguous() and out.dtype == torch.float32
            super().map_into(which, cap, layers, out)

    maps = Plain(Geometry.of(source, target)).bind(source, target)
    with torch.no_grad():
        maps.weight.copy_(random_maps(source, target, 2).weight)
        cap = capture(source, random_ids(20, target.config.vocab_size, 8))
        cache = empty_cache(target, 20, 4)
        maps(cap, precision="fast", out=cache.context(20))
        assert engine.compute_dtype(maps, torch.bfloat16, "fast") == torch.float32
        assert torch.equal(cache.context(20)[1], Headwise.map(maps, 1, cap, slice(None)))


def test_rows_per_head_tells_a_caches_layout_from_a_token_major_one():
    """Values map straight into an output whose heads' token rows are contiguous and whose layers and heads form one
    run of heads (a cache's context view); a token-major output (an engine's cache) goes through scratch."""
    cache = torch.empty(3, 2, 10, 4)
    assert engine.rows_per_head(cache[:, :, :7]) and engine.rows_per_head(cache[1:2, :, :7])
    token_major = torch.empty(3, 7, 2, 4).transpose(1, 2)
    assert not engine.rows_per_head(token_major) and not engine.rows_per_head(token_major[1:2])
    assert engine.rows_per_head(token_major[1:2, :, :1])  # one layer, one token: nothing to stride over


def test_chunked_translation_equals_per_head_reference(large32, small32):
    """The batched, layer-chunked path against a plain per-(layer, head) loop."""
    ids = random_ids(21, large32.config.vocab_size, 6)
    for key_space in ("prenorm", "cache"):
        maps = Headwise(Geometry.of(large32, small32), key_space).bind(large32, small32)
        with torch.no_grad():
            maps.weight.normal_(0, 0.3, generator=torch.Generator().manual_seed(1))
            maps.bias.normal_(0, 0.1, generator=torch.Generator().manual_seed(2))
            cap = capture(large32, ids)
            tr = maps
            full = tr(cap, chunk_elements=1 << 30)
            chunked = tr(cap, chunk_elements=1)  # one layer at a time
        assert torch.equal(full[0], chunked[0]) and torch.equal(full[1], chunked[1])
        # The in-place inference path does what the differentiable one does, in the same order:
        # the same bits in FP32, and the same single rounding into BF16.
        maps.requires_grad_(True)
        with torch.enable_grad():
            grad_k, grad_v = tr(cap)
            grad_bk, grad_bv = tr(cap, torch.bfloat16)
        assert torch.equal(grad_k.detach(), full[0]) and torch.equal(grad_v.detach(), full[1])
        with torch.no_grad():
            bk, bv = tr(cap, torch.bfloat16, chunk_elements=1)
        assert bk.dtype == torch.bfloat16 and torch.equal(grad_bk.detach(), bk) and torch.equal(grad_bv.detach(), bv)
        maps.requires_grad_(False)
        src_cos, src_sin = rope_tables(large32, 21)
        tgt_cos, tgt_sin = rope_tables(small32, 21)
        for l in range(cap.keys.shape[0]):
            for h in range(cap.keys.shape[1]):
                xk = cap.prenorm[l, h] if key_space == "prenorm" else strip_rope(cap.keys[l, h], src_cos, src_sin)
                yk = xk @ maps.weight[0, l, h] + maps.bias[0, l, h]
                if key_space == "prenorm":
                    yk = small32.model.layers[l].self_attn.k_norm(yk)
                yk = apply_rope(yk, tgt_cos, tgt_sin)
                yv = cap.values[l, h] @ maps.weight[1, l, h] + maps.bias[1, l, h]
                assert (full[0][l, h] - yk).abs().max().item() <= 1e-5
                assert (full[1][l, h] - yv).abs().max().item() <= 1e-5

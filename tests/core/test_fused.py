"""The compiled kernels of the keys (kvlingo/core/fused.py), the target side's finish and the source side's RoPE
strip: within their tolerance of the FP32 path, the FP32 bits where compiling fails, and the BF16 map output read
directly."""

from __future__ import annotations

import pytest
import torch
from refs import BF16_EPS, random_ids, random_maps

from kvlingo.core import engine, fused
from kvlingo.core.cache import capture, empty_cache
from kvlingo.core.engine import FAST_BF16_TOLERANCE


@pytest.fixture
def fused_any_size(monkeypatch):
    """The fused finish for chunks of any size (the tiny pair's are far under MIN_ELEMENTS), from a fresh state."""
    fused.reset()
    monkeypatch.setattr(fused, "MIN_ELEMENTS", 0)
    yield
    fused.reset()


@pytest.mark.parametrize(
    "key_space,dtype", [("prenorm", torch.float32), ("cache", torch.float32), ("prenorm", torch.bfloat16)]
)
def test_fused_key_finish_within_tolerance_of_fp32(models, fused_any_size, key_space, dtype):
    """k_norm and RoPE as one compiled kernel, written into a preallocated cache's context: keys within
    fused.TOLERANCE of the fp32 path per layer (plus one rounding in BF16), values bit for bit."""
    source, target = models["large", torch.float32], models["small", torch.float32]
    ids = random_ids(40, target.config.vocab_size, 11)
    maps = random_maps(source, target, 12, key_space)
    with torch.no_grad():
        cap = capture(source, ids)
        exact = maps(cap, dtype, precision="fp32")
        cache = empty_cache(target, 40, 3, dtype)
        got = maps(cap, precision="fused", out=cache.context(40))
    state = fused.status()
    if state["failure"]:
        pytest.skip(f"torch.compile cannot build the fused kernel here: {state['failure']}")
    # the compiled finish ran; in the cache key space the source keys' strip too
    assert state["compiled_by_kernel"] == {"finish": 1, **({"strip": 1} if key_space == "cache" else {})}
    assert state["skipped_chunks"] == 0 and torch.equal(got[1], exact[1])
    rounding = 0.0 if dtype == torch.float32 else BF16_EPS
    for layer in range(exact[0].shape[0]):
        ref = exact[0][layer].float()
        bound = (fused.TOLERANCE + rounding) * ref.abs().max().item()
        assert (got[0][layer].float() - ref).abs().max().item() <= bound
    assert cache.context(40)[0].data_ptr() == got[0].data_ptr()  # written in place, not copied


def test_fused_key_finish_falls_back_to_fp32_bits(models, fused_any_size, monkeypatch):
    """Where compiling fails (no C++ compiler) the eager finish runs, with the fp32 path's bits, and the
    reason is kept; past MAX_SHAPES new shapes run the eager finish as well."""
    source, target = models["large", torch.float32], models["small", torch.float32]
    maps = random_maps(source, target, 13)
    attempts = []

    def broken(*args, **kwargs):
        attempts.append(1)
        raise RuntimeError("InvalidCxxCompiler: No working C++ compiler found\nmore detail")

    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: broken)
    with torch.no_grad():
        cap = capture(source, random_ids(30, target.config.vocab_size, 14))
        exact = maps(cap, precision="fp32")
        for _ in range(2):
            got = maps(cap, precision="fused")
            assert torch.equal(got[0], exact[0]) and torch.equal(got[1], exact[1])
    assert len(attempts) == 1  # one failure is remembered, not retried per chunk
    assert fused.status()["failure"] == "RuntimeError: InvalidCxxCompiler: No working C++ compiler found"

    fused.reset()
    monkeypatch.undo()
    monkeypatch.setattr(fused, "MIN_ELEMENTS", 0)
    monkeypatch.setattr(fused, "MAX_SHAPES", 0)
    with torch.no_grad():
        got = maps(cap, precision="fused")
    assert torch.equal(got[0], exact[0]) and fused.status()["skipped_chunks"] == 1
    assert fused.status()["compiled_shapes"] == 0


def test_fast_fused_finish_reads_the_narrow_map_output_and_matches_fast(models, fused_any_size, monkeypatch):
    """`fast-fused` (BF16 maps, compiled finish): the kernel reads the BF16 key map itself, so no FP32 staging
    chunk is taken; keys within fused.TOLERANCE plus one BF16 rounding of `fast` and within FAST_BF16_TOLERANCE of
    `fp32`; values the same bits as `fast`'s."""
    from kvlingo.core import engine as T

    source, target = models["large", torch.float32], models["small", torch.float32]
    ids = random_ids(40, target.config.vocab_size, 21)
    maps = random_maps(source, target, 22)
    taken = []
    real_take = T.Scratch.take
    monkeypatch.setattr(
        T.Scratch, "take", lambda self, name, *a, **k: taken.append(name) or real_take(self, name, *a, **k)
    )
    with torch.no_grad():
        cap = capture(source, ids)
        exact = maps(cap, torch.bfloat16, precision="fp32")
        fast = maps(cap, torch.bfloat16, precision="fast")
        assert "yk" in taken  # the eager finish widens the BF16 map into FP32 scratch
        taken.clear()
        cache = empty_cache(target, 40, 3, torch.bfloat16)
        got = maps(cap, precision="fast-fused", out=cache.context(40))
    state = fused.status()
    if state["failure"]:
        pytest.skip(f"torch.compile cannot build the fused kernel here: {state['failure']}")
    assert state["compiled_shapes"] == 1 and state["skipped_chunks"] == 0  # the compiled kernel ran
    assert "low" in taken and "yk" not in taken  # BF16 map output only: no FP32 staging of the keys
    assert engine.compute_dtype(maps, torch.bfloat16, "fast-fused") == torch.bfloat16
    assert torch.equal(got[1], fast[1])
    for layer in range(exact[0].shape[0]):
        ref, eager = exact[0][layer].float(), fast[0][layer].float()
        mine = got[0][layer].float()
        assert (mine - eager).abs().max().item() <= (fused.TOLERANCE + BF16_EPS) * eager.abs().max().item()
        assert (mine - ref).abs().max().item() <= FAST_BF16_TOLERANCE * ref.abs().max().item()
    assert cache.context(40)[0].data_ptr() == got[0].data_ptr()


def random_token_maps(source, target, seed: int, rank: int = 4, key_space: str = "prenorm"):
    """The default family's maps (token input, window 3, head-wise base) with random weights, bound to the pair."""
    from kvlingo.core.families.tokeninput.maps import TokenInput
    from kvlingo.core.settings import Geometry

    maps = TokenInput(Geometry.of(source, target), key_space, rank=rank, window=3).bind(source, target)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in maps.parameters():
            p.normal_(0, 0.2, generator=g)
    return maps.requires_grad_(False)


@pytest.mark.parametrize("key_space", ["prenorm", "cache"])
def test_the_token_term_is_added_inside_the_fused_kernel(models, fused_any_size, monkeypatch, key_space):
    """The default family under `fused`: the base's key maps are written into the chunk and the token term goes to
    the compiled kernel, which adds it on its way (the sum is never written on its own). Keys within
    fused.TOLERANCE of fp32, values bit for bit; the handoff as it runs (exact layer 0, deferred values) then
    continues greedily to the same tokens; where compiling fails, the fp32 bits. In the cache key space the source
    keys' RoPE strip runs as its compiled kernel too."""
    from kvlingo.core.handoff import greedy_generate, translate_to_cache
    from kvlingo.core.settings import Refresh

    source, target = models["large", torch.float32], models["small", torch.float32]
    maps = random_token_maps(source, target, 31, key_space=key_space)
    addends = []
    real = fused.finish_keys
    monkeypatch.setattr(fused, "finish_keys", lambda *a: addends.append(a[6]) or real(*a))
    ids = random_ids(40, target.config.vocab_size, 32)
    with torch.no_grad():
        cap = capture(source, ids)
        exact = maps(cap, precision="fp32")
        assert not addends  # the fp32 path sums the terms itself
        got = maps(cap, precision="fused")
    state = fused.status()
    if state["failure"]:
        pytest.skip(f"torch.compile cannot build the fused kernel here: {state['failure']}")
    assert addends and all(a is not None and a.shape[1:] == exact[0].shape[1:] for a in addends)  # a chunk's term
    assert sum(a.shape[0] for a in addends) == exact[0].shape[0]  # every layer's keys through the kernel
    assert state["skipped_chunks"] == 0 and state["compiled_shapes"] >= 1
    assert ("strip" in state["compiled_by_kernel"]) == (key_space == "cache")
    assert torch.equal(got[1], exact[1])
    for layer in range(exact[0].shape[0]):
        ref = exact[0][layer]
        assert (got[0][layer] - ref).abs().max().item() <= fused.TOLERANCE * ref.abs().max().item()

    new = random_ids(3, target.config.vocab_size, 33)[0].tolist()
    tokens = {}
    for precision in ("fp32", "fused"):
        with torch.no_grad():
            cache = translate_to_cache(
                source,
                target,
                maps,
                ids,
                room=20,
                precision=precision,
                refresh=Refresh.parse("exact:0"),
                defer_values=True,
            )
            tokens[precision], _ = greedy_generate(target, new, cache=cache, max_new_tokens=12)
    assert tokens["fused"] == tokens["fp32"] and len(tokens["fp32"]) == 12

    fused.reset()  # no C++ compiler: the eager finish, with the token term summed first, has fp32's bits

    def broken(*args, **kwargs):
        raise RuntimeError("InvalidCxxCompiler: No working C++ compiler found")

    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: broken)
    with torch.no_grad():
        fallback = maps(cap, precision="fused")
    assert fused.status()["failure"] and torch.equal(fallback[0], exact[0]) and torch.equal(fallback[1], exact[1])


@pytest.mark.parametrize("keys_dtype,out_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16)])
def test_the_compiled_strip_is_the_eager_strip_within_tolerance(models, fused_any_size, keys_dtype, out_dtype):
    """The source keys' RoPE strip as one kernel, from the cache's dtype into the maps' input dtype: within
    fused.TOLERANCE of `strip_rope` in FP32 maths (one rounding into BF16 beside it), from a strided view of the
    cached keys into a strided (token-major) output."""
    from kvlingo.core.rope import RopeCache, strip_rope

    source = models["large", torch.float32]
    d = source.config.head_dim
    g = torch.Generator().manual_seed(3)
    keys = torch.randn(3, 2, 56, d, generator=g).to(keys_dtype)[1:3, :, :50]  # two layers of a longer cache
    cos, sin = RopeCache(source).inverse(50)
    out = torch.full((2, 50, 2, d), float("nan"), dtype=out_dtype).transpose(1, 2)
    assert fused.strip_keys(keys, cos, sin, out)
    want = strip_rope(keys.float(), cos, sin)
    rounding = 0.0 if out_dtype == torch.float32 else BF16_EPS
    assert (out.float() - want).abs().max().item() <= (fused.TOLERANCE + rounding) * want.abs().max().item()
    assert not out.isnan().any() and fused.status()["compiled_by_kernel"] == {"strip": 1}


def test_the_kernels_rope_is_transformers_rotation_bit_for_bit():
    """The kernels' RoPE (`fused._rope_halves`: the two halves over a [..., 2, d/2] view, one pointwise pass) is
    transformers' `apply_rotary_pos_emb` on the keys bit for bit, eagerly and compiled, with the sine negated too
    (the strip); into a token-major output as well."""
    from transformers.models.qwen3.modeling_qwen3 import apply_rotary_pos_emb

    g = torch.Generator().manual_seed(3)
    k = torch.randn(2, 3, 40, 16, generator=g)
    angles = torch.randn(40, 8, generator=g)
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    for s in (sin, -sin):
        _, want = apply_rotary_pos_emb(k, k, cos[None], s[None])  # tables [batch, tokens, d]
        assert torch.equal(fused._rope_halves(k, cos, s), want)
        out = torch.empty(2, 40, 3, 16).transpose(1, 2)
        torch.compile(lambda y, c, t, o: o.copy_(fused._rope_halves(y, c, t)), dynamic=False)(k, cos, s, out)
        assert torch.equal(out, want)

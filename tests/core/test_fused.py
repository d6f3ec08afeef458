"""The compiled finish of the keys (kvlingo/core/fused.py): within its tolerance of the FP32 path, the FP32 bits
where compiling fails, and the BF16 map output read directly."""

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
    assert state["compiled_shapes"] == 1 and state["skipped_chunks"] == 0  # the compiled kernel ran
    assert torch.equal(got[1], exact[1])
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

"""Key spaces (kvlingo/core/keyspace.py): identity maps reproduce the native cache, and each RoPE schedule's keys
round-trip to the model's own cached keys in FP32 and BF16."""

from __future__ import annotations

import pytest
import torch
from refs import random_ids, split_reference
from tinypair import ROPE_SCHEDULES, tiny_model

from kvlingo.core.cache import capture, continue_from
from kvlingo.core.families.headwise.maps import Headwise
from kvlingo.core.keyspace import KeySpace
from kvlingo.core.translator import Geometry

BF16_EPS = 2.0**-8
SCHEDULES = sorted(ROPE_SCHEDULES)


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_key_spaces_reproduce_the_models_own_cached_keys(model_type, schedule):
    """Pre-norm features finished with the model's own (k_norm and) RoPE are its cached keys; cached keys
    stripped and re-applied come back; without k_norm the stripped key is the pre-norm feature itself."""
    model = tiny_model(model_type, schedule)
    T = 40  # longrope: the long regime (switch at 24)
    with torch.no_grad():
        cap = capture(model, torch.randint(0, 320, (1, T), generator=torch.Generator().manual_seed(1)))
    top = cap.keys.abs().max().item()
    prenorm, cache = KeySpace("prenorm", model, model), KeySpace("cache", model, model)
    assert (prenorm.finish_keys(prenorm.source_keys(cap)) - cap.keys).abs().max().item() <= 1e-6 * top
    stripped = cache.source_keys(cap)
    assert (cache.finish_keys(stripped) - cap.keys).abs().max().item() <= 1e-6 * top
    if model_type != "qwen3":  # no k_norm: the pre-norm key space is the pre-RoPE key
        assert prenorm.k_norm_weight is None
        assert (stripped - cap.prenorm).abs().max().item() <= 1e-6 * cap.prenorm.abs().max().item()


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_bf16_round_trip_returns_the_cached_keys(schedule):
    """BF16 cached keys stripped and re-applied in FP32, rounded once: the same keys. Measured (head_dim 64,
    300 positions): every nonzero key bit for bit; keys cached as exactly 0 come back as FP32 noise
    ≤ 3e-8 × max|key| (0.008-0.018% of elements). Allowed: rare one-BF16-step changes besides."""
    model = tiny_model("llama", schedule, dtype=torch.bfloat16)
    space = KeySpace("cache", model, model)
    with torch.no_grad():
        cap = capture(model, torch.randint(0, 320, (1, 200), generator=torch.Generator().manual_seed(2)))
    back = space.finish_keys(space.source_keys(cap)).to(torch.bfloat16).float()
    keys = cap.keys.float()
    zero = keys == 0
    assert (back[zero].abs() <= 1e-6 * keys.abs().max()).all()
    differ = (back != keys) & ~zero
    assert differ.float().mean().item() < 1e-3
    assert ((back - keys).abs()[differ] <= 2 * BF16_EPS * keys.abs()[differ]).all()  # one BF16 step at most


@pytest.mark.parametrize("key_space", ["prenorm", "cache"])
def test_identity_maps_reproduce_native_cache(large32, key_space):
    ids = random_ids(29, large32.config.vocab_size, 4)
    maps = Headwise.identity(Geometry.of(large32, large32), key_space).bind(large32, large32)
    with torch.no_grad():
        cap = capture(large32, ids[:, :24])
        keys, values = maps(cap)
        assert torch.equal(values, cap.values)
        tol = 0.0 if key_space == "prenorm" else 1e-5  # prenorm replays the model's own ops; cache adds strip+apply
        assert (keys - cap.keys).abs().max().item() <= tol
        got = continue_from(large32, keys, values, ids[:, 24:]).logits[0]
    ref = split_reference(large32, ids[:, :24], ids[:, 24:])
    assert (got - ref).abs().max().item() <= (1e-6 if key_space == "prenorm" else 1e-4)

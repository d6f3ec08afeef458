"""RoPE schedules (default, linear, llama3, yarn, longrope): the tables apply exactly what transformers'
own `apply_rotary_pos_emb` applies (attention scaling included), the strip tables undo it, and a
schedule whose rotation depends on the sequence length (dynamic) is refused."""

from __future__ import annotations

import pytest
import torch
from tinypair import ROPE_SCHEDULES, tiny_model
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from kvlingo.core.cache import capture
from kvlingo.core.keyspace import KeySpace
from kvlingo.core.rope import RopeCache, apply_rope, schedule_refusal, strip_rope
from kvlingo.inputs.models import PairError, check_pair

BF16_EPS = 2.0**-8
SCHEDULES = sorted(ROPE_SCHEDULES)


def transformers_rotation(model, k: torch.Tensor) -> torch.Tensor:
    """k [1, heads, T, head_dim] rotated by transformers' own function with the model's own rotary tables."""
    cos, sin = model.model.rotary_emb(k, torch.arange(k.shape[2])[None])
    return apply_rotary_pos_emb(k, k, cos, sin)[1]


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_apply_is_transformers_rotation_and_strip_inverts_it(schedule):
    model = tiny_model("llama", schedule)
    rope = RopeCache(model)
    lengths = (20, 60) if schedule == "longrope" else (60,)  # longrope: both sides of its switch (24)
    for T in lengths:
        k = torch.randn(1, 2, T, 16, generator=torch.Generator().manual_seed(T))
        ref = transformers_rotation(model, k)[0]  # [heads, T, head_dim]
        assert torch.equal(apply_rope(k[0], *rope(T)), ref)
        back = strip_rope(ref, *rope.inverse(T))
        assert (back - k[0]).abs().max().item() <= 1e-6 * k.abs().max().item()  # measured ≤ 2.2e-7 relative
    scaling = model.model.rotary_emb.attention_scaling
    assert (scaling != 1.0) == (schedule in ("yarn", "longrope")) and rope.scaling == scaling
    if scaling != 1.0:  # the inverse must undo the attention scaling, not only the rotation
        unscaled = strip_rope(ref, *rope(T))
        assert (unscaled - k[0]).abs().max().item() > 0.1 * k.abs().max().item()


def test_longrope_keeps_one_table_per_regime():
    """A longer request must not hand a short capture the long regime's tables, and vice versa."""
    model = tiny_model("llama", "longrope")
    rope = RopeCache(model)
    long_cos, _ = rope(60)
    short_cos, _ = rope(20)
    k = torch.randn(1, 2, 20, 16, generator=torch.Generator().manual_seed(0))
    assert torch.equal(apply_rope(k[0], short_cos, rope(20)[1]), transformers_rotation(model, k)[0])
    assert not torch.allclose(long_cos[:20], short_cos)
    assert rope.tables[False][0].shape[0] <= 24  # the short table never grows past the switch


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


def test_dynamic_and_unknown_schedules_are_refused_with_the_fix():
    from tinypair import qwen3_config

    dynamic = qwen3_config(320, 64, 4, 10_000.0)
    dynamic.rope_parameters = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10_000.0}
    with pytest.raises(PairError, match=r"'dynamic'.*depends on the sequence length.*'linear' or 'yarn'"):
        check_pair(qwen3_config(320, 64, 4, 10_000.0), dynamic)
    assert "not supported" in schedule_refusal({"rope_type": "proportional", "rope_theta": 1.0})
    assert "partial_rotary_factor" in schedule_refusal({"rope_type": "default", "partial_rotary_factor": 0.5})
    for schedule in SCHEDULES:
        assert schedule_refusal(ROPE_SCHEDULES[schedule]) is None
    model = tiny_model("llama", {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10_000.0})
    with pytest.raises(ValueError, match="depends on the sequence length"):
        RopeCache(model)

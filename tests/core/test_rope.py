"""RoPE (kvlingo/core/rope.py): in place and functional, strip and re-apply against transformers' own
`apply_rotary_pos_emb` for every schedule (default, linear, llama3, yarn, longrope), and a schedule whose rotation
depends on the sequence length (dynamic) refused."""

from __future__ import annotations

import pytest
import torch
from refs import BF16_EPS, random_ids
from tinypair import ROPE_SCHEDULES, tiny_model
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from kvlingo.core.cache import capture
from kvlingo.core.keyspace import rms_norm, rms_norm_
from kvlingo.core.rope import RopeCache, apply_rope, apply_rope_into, rope_tables, schedule_refusal, strip_rope
from kvlingo.inputs.models import PairError, check_pair

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


def _post_norm_pre_rope_keys(model, ids):
    """Independent reference: hook each layer's k_norm output (post-norm, before RoPE)."""
    outs, hooks = (
        [],
        [l.self_attn.k_norm.register_forward_hook(lambda m, i, o: outs.append(o)) for l in model.model.layers],
    )
    try:
        with torch.no_grad():
            model(input_ids=ids)
    finally:
        for h in hooks:
            h.remove()
    return torch.stack([o[0].transpose(0, 1) for o in outs])  # [layers, heads, tokens, dim]


def test_in_place_rope_and_norm_equal_the_functional_ones_bit_for_bit(large32):
    g = torch.Generator().manual_seed(5)
    k = torch.randn(2, 2, 37, 16, generator=g) * 3
    cos, sin = rope_tables(large32, 37)
    out, half = torch.empty_like(k), torch.empty(2, 2, 37, 8)
    assert torch.equal(apply_rope_into(k, cos, sin, out, half), apply_rope(k, cos, sin))
    w = torch.rand(2, 16, generator=g) + 0.5
    ref = rms_norm(k, w, 1e-6)
    assert torch.equal(rms_norm_(k.clone(), w, 1e-6, torch.empty_like(k)), ref)


def test_rope_strip_is_exact_inverse_fp32_and_bf16(large32):
    cos, sin = rope_tables(large32, 50)
    k = torch.randn(2, 2, 50, 16, generator=torch.Generator().manual_seed(3)) * 3
    back = strip_rope(apply_rope(k, cos, sin), cos, sin)
    assert (back - k).abs().max().item() <= 1e-5  # two FP32 rotations of |k|≲15: a few ulps
    # BF16 recipe: rotate in FP32, round once, strip in FP32 → error bounded by that one rounding
    kb = k.bfloat16()
    rotated = apply_rope(kb.float(), cos, sin).bfloat16()
    back_b = strip_rope(rotated.float(), cos, sin)
    bound = BF16_EPS * kb.float().abs().max().item() * 2  # |rotation| preserves norms; ≤1 rounding per pair
    assert (back_b - kb.float()).abs().max().item() <= bound


def test_strip_source_schedule_reapply_target_matches_transformers(large32, small32):
    from transformers.models.qwen3.modeling_qwen3 import apply_rotary_pos_emb

    assert large32.config.rope_parameters["rope_theta"] != small32.config.rope_parameters["rope_theta"]
    ids = random_ids(33, large32.config.vocab_size, 2)
    with torch.no_grad():
        cap = capture(large32, ids)
    unrotated = _post_norm_pre_rope_keys(large32, ids)
    cos_s, sin_s = rope_tables(large32, 33)
    stripped = strip_rope(cap.keys, cos_s, sin_s)
    assert (stripped - unrotated).abs().max().item() <= 1e-5
    cos_t, sin_t = rope_tables(small32, 33)
    ours = apply_rope(stripped, cos_t, sin_t)
    ref_cos, ref_sin = small32.model.rotary_emb(torch.empty(0), torch.arange(33)[None])
    _, theirs = apply_rotary_pos_emb(unrotated, unrotated, ref_cos, ref_sin)
    assert (ours - theirs).abs().max().item() <= 1e-5
    # and the schedules really differ: re-applying the source's own gives something else
    assert (apply_rope(stripped, cos_s, sin_s) - theirs).abs().max().item() > 1e-2

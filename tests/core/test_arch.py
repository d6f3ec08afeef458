"""Llama and Qwen2/2.5 beside Qwen3 (kvlingo/core/arch.py): capture and injection are exact, and Qwen2's implicit
head_dim is read. References: transformers' own split execution and its own `apply_rotary_pos_emb`."""

from __future__ import annotations

import pytest
import torch
from refs import BF16_EPS, tiny_ids
from tinypair import tiny_model
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from kvlingo.core.cache import capture, continue_from
from kvlingo.core.families.headwise.maps import Headwise
from kvlingo.core.translator import Geometry

FAMILIES = [("llama", "llama3"), ("llama", "default"), ("qwen2", "yarn"), ("qwen2", "default")]


def split_reference(model, prefix, new):
    with torch.no_grad():
        first = model(input_ids=prefix, use_cache=True)
        return model(input_ids=new, cache=first.cache, use_cache=True).logits[0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("model_type,schedule", FAMILIES)
def test_injected_own_cache_reproduces_split_execution(model_type, schedule, dtype):
    model = tiny_model(model_type, schedule, dtype=dtype)
    ids = tiny_ids(48)
    prefix, new = ids[:, :39], ids[:, 39:]
    ref = split_reference(model, prefix, new)
    with torch.no_grad():
        cap = capture(model, prefix)
        got = continue_from(model, cap.keys, cap.values, new).logits[0]
        shifted = continue_from(model, cap.keys[:, :, 1:], cap.values[:, :, 1:], new).logits[0]
    top = ref.float().abs().max().item()
    assert (got.float() - ref.float()).abs().max().item() <= (1e-6 if dtype == torch.float32 else BF16_EPS * top)
    assert (shifted.float() - ref.float()).abs().max().item() > 1e-3  # the test can see a wrong cache


@pytest.mark.parametrize("model_type,schedule", FAMILIES)
def test_capture_holds_the_pre_rope_key_and_a_prenorm_identity_is_exact(model_type, schedule):
    """No k_norm: transformers' own RoPE of the captured k_proj output (bias included) is the cached key,
    and head-wise identity maps in the pre-norm key space hand back the model's own cache."""
    model = tiny_model(model_type, schedule)
    assert not hasattr(model.model.layers[0].self_attn, "k_norm")
    if model_type == "qwen2":
        assert model.model.layers[0].self_attn.k_proj.bias.abs().max() > 0
    ids = tiny_ids(30, 1)
    with torch.no_grad():
        cap = capture(model, ids)
    cos, sin = model.model.rotary_emb(cap.prenorm, torch.arange(30)[None])
    for i in range(model.config.num_hidden_layers):
        k = cap.prenorm[i][None]  # [1, kv_heads, T, head_dim]
        assert torch.equal(apply_rotary_pos_emb(k, k, cos, sin)[1][0], cap.keys[i])
    identity = Headwise.identity(Geometry.of(model, model), "prenorm").bind(model, model)
    with torch.no_grad():
        keys, values = identity(cap)
    assert torch.equal(keys, cap.keys) and torch.equal(values, cap.values)


def test_qwen2_geometry_reads_the_implicit_head_dim():
    model = tiny_model("qwen2", heads=4, kv_heads=2)
    assert getattr(model.config, "head_dim", None) is None
    assert Geometry.of(model, model).source_head_dim == 16

"""The exact layer 0 (kvlingo/core/layer0.py): keys and values from token ids alone against the target's own cache
from a real forward (bit for bit in FP32, in Qwen3, Qwen2 and Llama), and a first layer that is not context-free
refused by name."""

from __future__ import annotations

import pytest
import torch
from refs import own_cache
from tinypair import load_tiny_pair

from kvlingo.core.cache import capture
from kvlingo.core.families.crosslayer.maps import CrossHead
from kvlingo.core.layer0 import ContextFree, NotContextFree, check
from kvlingo.core.refresh import Refresh, RefreshError, refreshed_kv
from kvlingo.core.translator import Geometry


def tiny(kind: str, dtype=torch.float32):
    """A random tiny model of each family the exact layer 0 serves (Qwen2: projection biases; Llama: llama3 RoPE)."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    common = dict(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
    )
    if kind == "qwen2":
        return Qwen2ForCausalLM(Qwen2Config(**common)).to(dtype).eval()
    rope = {
        "rope_type": "llama3",
        "rope_theta": 500_000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32,
    }
    return LlamaForCausalLM(LlamaConfig(**common, head_dim=32, rope_parameters=rope)).to(dtype).eval()


@pytest.fixture(scope="module")
def pair(tiny_pair_paths, one_thread):
    return load_tiny_pair(tiny_pair_paths)


def test_layer0_from_token_ids_is_the_targets_own_cache_bit_for_bit(pair, tiny_pair_paths):
    g = torch.Generator().manual_seed(1)
    for model in (pair.source, pair.target, tiny("qwen2"), tiny("llama")):
        ids = torch.randint(0, model.config.vocab_size, (1, 53), generator=g)
        k, v = ContextFree(model).kv(ids[0])
        own_k, own_v = own_cache(model, ids)[0]
        assert k.dtype == torch.float32 and torch.equal(k, own_k) and torch.equal(v, own_v), model.config.model_type
        if model.config.model_type == "qwen3":  # the suite's own capture too (preallocated cache, pre-norm keys)
            cap = capture(model, ids, want_prenorm=True)
            assert torch.equal(k, cap.keys[0]) and torch.equal(v, cap.values[0])
            assert torch.equal(ContextFree(model).prenorm(ids[0]), cap.prenorm[0])
    # positions continue: the K/V of tokens 20.. at positions 20.. are the same slice of the whole forward's
    ids = torch.randint(0, pair.target.config.vocab_size, (1, 53), generator=g)
    k, v = ContextFree(pair.target).kv(ids[0, 20:], start=20)
    own_k, own_v = own_cache(pair.target, ids)[0]
    assert torch.allclose(k, own_k[:, 20:], rtol=0, atol=1e-6) and torch.allclose(v, own_v[:, 20:], rtol=0, atol=1e-6)
    # BF16 follows the same operations: the same bits as the model's own BF16 cache
    bf = load_tiny_pair(tiny_pair_paths, dtype=torch.bfloat16).target
    ids = torch.randint(0, bf.config.vocab_size, (1, 40), generator=g)
    k, v = ContextFree(bf).kv(ids[0])
    own_k, own_v = own_cache(bf, ids)[0]
    assert k.dtype == torch.bfloat16 and torch.equal(k, own_k) and torch.equal(v, own_v)


def test_a_first_layer_that_is_not_context_free_is_refused_by_name(pair):
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    cfg = Qwen3NextConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        linear_num_value_heads=2,
        linear_num_key_heads=1,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        num_experts=2,
        num_experts_per_tok=1,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=16,
    )
    assert cfg.layer_types[0] == "linear_attention"  # a Gated DeltaNet layer: its state mixes the tokens
    with pytest.raises(NotContextFree, match="'qwen3_next'.*not known to be context-free.*layer:0"):
        check(cfg)
    other = Qwen3NextForCausalLM(cfg)
    tr = CrossHead(Geometry.of(pair.source, pair.target)).bind(pair.source, pair.target)
    tr.requires_grad_(False)
    ids = torch.randint(0, 60, (1, 12))
    with torch.no_grad():
        cap = capture(pair.source, ids, want_prenorm=True, logits_to_keep=1)
    with pytest.raises(RefreshError, match="exact:0: the first layer of a 'qwen3_next'"):
        refreshed_kv(pair.source, other, tr, ids, Refresh.parse("exact:0"), cap=cap)
    check(pair.target.config)  # the families the suite serves pass


@pytest.mark.parametrize("model_type,schedule", [("qwen3", "default"), ("qwen2", "yarn")])
def test_the_token_features_span_the_column_space_of_the_k_and_v_projections(model_type, schedule):
    """`feature_span`: where 2 · KV width (32) > hidden (16), the features [W_k; W_v] h (+ b: Qwen2's biases) lie in
    an orthonormal basis of 16 directions (17 with the biases) computed from the weights, and reach every one of
    them; where 2 · KV width ≤ hidden, None."""
    from refs import random_ids
    from tinypair import tiny_model

    model = tiny_model(model_type, schedule, hidden=16, heads=2, kv_heads=2, head_dim=8)
    lz = ContextFree(model)
    span = lz.feature_span()
    k = 16 + (model_type == "qwen2")
    assert span.shape == (32, k) and torch.allclose(span.T @ span, torch.eye(k, dtype=torch.float64))
    t = lz.token_features(random_ids(120, 320, 3)).double()  # [tokens, 32]
    inside = t @ span
    assert (t - inside @ span.T).abs().max() < 1e-5 * t.abs().max()  # they lie in it, but for rounding
    assert torch.linalg.matrix_rank(inside).item() == k  # and reach every direction of it
    assert ContextFree(tiny_model(model_type, schedule)).feature_span() is None  # hidden 64 ≥ 2 · KV width 32

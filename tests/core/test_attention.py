"""Attention without repeated K/V (kvlingo/core/attention.py): grouped-query SDPA against transformers' with
repeats, and deferred attention against SDPA over the translated values."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from refs import BF16_EPS, random_ids

from kvlingo.core import attention
from kvlingo.core.cache import capture, continue_from
from kvlingo.core.preallocated import Deferred


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
    # A row's matmuls at another number of rows may take another kernel blocking (another order of the same sums):
    # a few float32 steps of the output's scale, not bit for bit.
    chunked = attention.deferred_attention(query, key, own, mask, deferred, scaling=0.3)
    assert (chunked - got).abs().max().item() <= 8 * torch.finfo(torch.float32).eps * got.abs().max().item()


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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gqa_attention_equals_transformers_sdpa_with_repeats(dtype):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import sdpa_mask

    class Module:  # what transformers' attention functions read from the attention module
        num_key_value_groups, is_causal = 3, True

    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 6, 5, 16, generator=g).to(dtype)  # 6 query heads over 2 KV heads, 5 new tokens
    k, v = (torch.randn(1, 2, 12, 16, generator=g).to(dtype) for _ in range(2))  # 7 cached + 5 new
    mask = sdpa_mask(batch_size=1, q_length=5, kv_length=12, q_offset=7, allow_is_causal_skip=False)
    ref, _ = sdpa_attention_forward(Module(), q, k, v, mask, scaling=0.25)
    got, _ = attention.gqa_sdpa_forward(Module(), q, k, v, mask, scaling=0.25)
    assert got.shape == ref.shape == (1, 5, 6, 16)
    diff = (got.float() - ref.float()).abs().max().item()
    # FP32: the same softmax rows in another order of summation; BF16: one rounding of the output (|out| ≤ max |v|)
    assert diff <= (1e-6 if dtype == torch.float32 else BF16_EPS * v.float().abs().max().item())
    # without a mask (a prefill on is_causal) it is transformers' own call
    same, _ = attention.gqa_sdpa_forward(Module(), q, k[:, :, :5], v[:, :, :5], None, scaling=0.25)
    theirs, _ = sdpa_attention_forward(Module(), q, k[:, :, :5], v[:, :, :5], None, scaling=0.25)
    assert torch.equal(same, theirs)


def test_new_turn_on_preallocated_cache_never_repeats_kv(models, monkeypatch):
    model = models["small", torch.float32]
    ids = random_ids(30, model.config.vocab_size)
    with torch.no_grad():
        cap = capture(model, ids[:, :24])
    seen = []
    sdpa = F.scaled_dot_product_attention

    def spy(q, k, v, *args, **kwargs):
        seen.append((q.shape[1], k.shape[1]))
        return sdpa(q, k, v, *args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    with torch.no_grad():
        continue_from(model, cap.keys, cap.values, ids[:, 24:], kind="preallocated")
    kv_heads = model.config.num_key_value_heads
    assert seen and all(k_heads == kv_heads for _, k_heads in seen)  # K/V reach SDPA with their own heads
    seen.clear()
    with torch.no_grad():
        continue_from(model, cap.keys, cap.values, ids[:, 24:], kind="dynamic")
    assert seen and all(k_heads == model.config.num_attention_heads for _, k_heads in seen)  # as shipped: repeated
    assert model.config._attn_implementation == "sdpa"  # switched back after the call

"""Capture and injection (kvlingo/core/cache.py) against transformers' own cache and split execution; a wrong
layout and a batch of more than one are refused."""

from __future__ import annotations

import pytest
import torch
from refs import BF16_EPS, random_ids, split_reference

from kvlingo.core.cache import build_cache, capture, check_batch, continue_from
from kvlingo.inputs.models import ModelSpec, load_model


# --------------------------------------------------------------------------- injection
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_injecting_own_cache_reproduces_split_execution(tiny_pair_paths, dtype):
    for path in tiny_pair_paths:
        model = load_model(ModelSpec.parse(str(path)), "cpu", dtype)
        ids = random_ids(40, model.config.vocab_size)
        prefix, new = ids[:, :31], ids[:, 31:]
        ref = split_reference(model, prefix, new)
        with torch.no_grad():
            cap = capture(model, prefix)
            got = continue_from(model, cap.keys, cap.values, new).logits[0]
        diff = (got.float() - ref.float()).abs().max().item()
        if dtype == torch.float32:
            assert diff <= 1e-6
        else:
            # Same tensors feed the same BF16 kernels, so we expect 0; allow one BF16 rounding of the largest logit.
            assert diff <= BF16_EPS * ref.float().abs().max().item()
        # positions continue after the injected cache: a cache of the wrong length must change the logits
        with torch.no_grad():
            shifted = continue_from(model, cap.keys[:, :, 1:], cap.values[:, :, 1:], new).logits[0]
        assert (shifted.float() - ref.float()).abs().max().item() > 1e-3


def test_capture_matches_transformers_cache_and_prenorm_hook(large32):
    ids = random_ids(17, large32.config.vocab_size, 1)
    with torch.no_grad():
        out = large32(input_ids=ids, use_cache=True)
        cap = capture(large32, ids)
    for i, layer in enumerate(out.cache.layers):
        assert torch.equal(cap.keys[i], layer.keys[0]) and torch.equal(cap.values[i], layer.values[0])
    # pre-norm features: applying the model's own k_norm + RoPE to them gives the cached keys
    from transformers.models.qwen3.modeling_qwen3 import apply_rotary_pos_emb

    cos, sin = large32.model.rotary_emb(torch.empty(0), torch.arange(17)[None])
    for i, layer in enumerate(large32.model.layers):
        k = layer.self_attn.k_norm(cap.prenorm[i].transpose(0, 1)).transpose(0, 1)[None]  # [1, H, T, D]
        _, k = apply_rotary_pos_emb(k, k, cos, sin)
        assert torch.equal(k[0], cap.keys[i])


def test_build_cache_rejects_wrong_layout(large32):
    with pytest.raises(ValueError, match="layers="):
        build_cache(large32, torch.zeros(1, 2, 3, 16), torch.zeros(1, 2, 3, 16))


def test_batch_larger_than_one_refused():
    check_batch(torch.zeros(1, 5, dtype=torch.long))
    with pytest.raises(ValueError, match="batch-one"):
        check_batch(torch.zeros(2, 5, dtype=torch.long))

"""Attention over grouped-query K/V without materialising the repeated heads.

transformers' `sdpa` attention repeats every KV head for each query head it serves whenever
a mask is present, which is every new turn of more than one token on top of a cache: at
4,096 cached tokens that is a copy of twice the layer's K/V per layer (and CPU SDPA with a
mask and `enable_gqa` is slower still). Here the query heads that share a KV head are packed
into that head's rows instead:

    query [B, q_heads, q, d] → [B, kv_heads, groups·q, d]   (query head h = kv·groups + j → rows j·q .. j·q+q-1)
    mask  [B, 1, q, kv]      → [B, 1, groups·q, kv]          (each query's row, repeated per group)

one SDPA call then reads each KV head once, and every output row is the same softmax over
the same keys as before. Without a mask (a prefill on `is_causal`, or one query) the call
goes to transformers' own `sdpa` function, which uses SDPA's `enable_gqa` there already.

The function is registered through transformers' `AttentionInterface` as `NAME`, with
transformers' own sdpa mask builder under the same name; `using(model, NAME)` switches a
model to it for one call and back. The switch sets the model config's attention
implementation, which every attention module and the mask builder read at call time (one
attribute, so it costs nothing next to a forward, even a CUDA one).
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.nn.functional as F

NAME = "kvlingo_gqa_sdpa"


def gqa_sdpa_forward(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                     is_causal: bool | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention signature: query [B, q_heads, q, d], key/value [B, kv_heads, kv, d],
    mask [B, 1, q, kv] or None → ([B, q, q_heads, d], None)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    groups = getattr(module, "num_key_value_groups", 1)
    if attention_mask is None or groups == 1 or attention_mask.dim() != 4 or attention_mask.shape[1] != 1 \
            or kwargs.get("position_bias") is not None or kwargs.get("softcap") is not None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    b, q_heads, q, d = query.shape
    kv_heads, mb, kv = key.shape[1], attention_mask.shape[0], attention_mask.shape[-1]
    packed = query.reshape(b, kv_heads, groups * q, d)  # [B, kv_heads, groups·q, d]
    mask = attention_mask[:, :, None].expand(mb, 1, groups, q, kv).reshape(mb, 1, groups * q, kv)
    out = F.scaled_dot_product_attention(packed, key, value, attn_mask=mask, dropout_p=dropout, scale=scaling)
    return out.reshape(b, q_heads, q, -1).transpose(1, 2).contiguous(), None  # [B, q, q_heads, d]


_registered = False


def register() -> None:
    """Make `NAME` a valid attention implementation for any transformers model (idempotent)."""
    global _registered
    if _registered:
        return
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(NAME, gqa_sdpa_forward)
    AttentionMaskInterface.register(NAME, sdpa_mask)
    _registered = True


@contextmanager
def using(model, implementation: str | None):
    """Run `model` with attention `implementation` inside the block (None: as it is), then switch back."""
    before = model.config._attn_implementation
    if implementation is None or implementation == before:
        yield
        return
    if implementation == NAME:
        register()
    if any(getattr(m, "config", model.config) is not model.config for m in (model, getattr(model, "model", model))):
        raise ValueError("attention.using needs a model whose decoder shares the top-level config (Qwen3 does)")
    model.config._attn_implementation = implementation
    try:
        yield
    finally:
        model.config._attn_implementation = before

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

On a cache whose context values are deferred (kvlingo.core.preallocated: views of the source's
values plus an affine map per layer, `ValueMaps`), `run_with_cache` passes the cache as the
attention keyword `DEFERRED`, and the layer attends as softmax weights p over [context | own]
keys, then, for each query row of target head j,

    out = (Σ p_context · x) W_j + (Σ p_context) b_j + p_own · V_own

where x concatenates the source values head j reads (`mix_sources`: head j alone for
head-wise maps, every source head of every source layer read for the others) and a low-rank
map applies its shared first factor to the mix before W_j. The scores and softmax are written
out (FP32 softmax, as transformers' eager attention), the query rows in chunks of at most
`SCORE_ELEMENTS` scores.

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
DEFERRED = "kvlingo_deferred"  # attention keyword: the cache whose layers hold deferred context values
SCORE_ELEMENTS = 1 << 24  # deferred attention: scores held at once (64 MiB in FP32)


def gqa_sdpa_forward(
    module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention signature: query [B, q_heads, q, d], key/value [B, kv_heads, kv, d],
    mask [B, 1, q, kv] or None → ([B, q, q_heads, d], None)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    cache = kwargs.pop(DEFERRED, None)
    layer = cache.layers[module.layer_idx] if cache is not None else None
    if layer is not None and layer.deferred is not None:
        return deferred_attention(query, key, value, attention_mask, layer.deferred, scaling), None
    groups = getattr(module, "num_key_value_groups", 1)
    if (
        attention_mask is None
        or groups == 1
        or attention_mask.dim() != 4
        or attention_mask.shape[1] != 1
        or kwargs.get("position_bias") is not None
        or kwargs.get("softcap") is not None
    ):
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs
        )
    b, q_heads, q, d = query.shape
    kv_heads, mb, kv = key.shape[1], attention_mask.shape[0], attention_mask.shape[-1]
    packed = query.reshape(b, kv_heads, groups * q, d)  # [B, kv_heads, groups·q, d]
    mask = attention_mask[:, :, None].expand(mb, 1, groups, q, kv).reshape(mb, 1, groups * q, kv)
    out = F.scaled_dot_product_attention(packed, key, value, attn_mask=mask, dropout_p=dropout, scale=scaling)
    return out.reshape(b, q_heads, q, -1).transpose(1, 2).contiguous(), None  # [B, q, q_heads, d]


def deferred_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    deferred,
    scaling: float | None = None,
) -> torch.Tensor:
    """Attention of query [1, q_heads, q, d] over key [1, kv_heads, n + own, d], whose first n tokens'
    values are `deferred` (`preallocated.Deferred`: the source's values of the layers read and the map)
    and the rest's are `value` [1, kv_heads, own, d_v]; mask [B, 1, q, n + own] (bool: attend, or
    additive) or None (every query sees every key; a new turn of more than one token always has one).
    Returns [1, q, q_heads, d_v]."""
    if query.shape[0] != 1:
        raise ValueError("deferred values are batch-one")
    _, q_heads, q, d = query.shape
    kv_heads, kv, n = key.shape[1], key.shape[2], deferred.tokens
    groups = q_heads // kv_heads
    if kv != n + value.shape[2]:
        raise ValueError(f"{kv} keys but {n} deferred and {value.shape[2]} own values")
    scale = d**-0.5 if scaling is None else scaling
    packed = query[0].reshape(kv_heads, groups, q, d)  # query head h = kv·groups + j
    keys_t = key[0].transpose(1, 2)  # [kv_heads, d, kv]
    own_values = value[0]
    weight, bias = deferred.weight.float(), deferred.bias[:, None].float()  # [kv_heads, d_x, d_v], [kv_heads, 1, d_v]
    down = None if deferred.down is None else deferred.down.float()  # [mix width, rank]
    out = query.new_empty(1, q, q_heads, own_values.shape[-1])
    step = max(1, SCORE_ELEMENTS // (kv_heads * groups * kv))
    for begin in range(0, q, step):  # query rows in chunks, so the scores stay bounded for a long new turn
        rows = slice(begin, min(q, begin + step))
        r = rows.stop - begin
        scaled = packed[:, :, rows].reshape(kv_heads, groups * r, d) * scale  # the scale on the few query rows
        scores = torch.bmm(scaled, keys_t).float()  # [kv_heads, groups·r, kv]
        if mask is not None:
            m = mask[0, 0, rows]  # [r, kv]
            boolean = m.dtype == torch.bool
            # a new turn sees the whole context: then only its own columns are masked (the rest is one pass less).
            # Looked at on a CPU only: elsewhere reading the mask would wait for the device (and break a CUDA graph).
            sees_context = m.device.type == "cpu" and bool(m[:, :n].all() if boolean else not m[:, :n].any())
            cols = slice(n, kv) if sees_context else slice(0, kv)
            m = m[:, cols][None].expand(groups, r, -1).reshape(1, groups * r, -1)
            if boolean:
                scores[:, :, cols].masked_fill_(~m, float("-inf"))
            else:
                scores[:, :, cols].add_(m)
        p = torch.softmax(scores, dim=-1)  # [kv_heads, groups·r, kv], FP32
        own = p[:, :, n:]
        context_weight = 1.0 - own.sum(-1, keepdim=True)  # Σ p over the context, from the few own columns
        context = mix_sources(p[:, :, :n], deferred)  # [kv_heads, groups·r, mix width], FP32
        if down is not None:
            context = context @ down  # [kv_heads, groups·r, rank]
        mixed = torch.baddbmm(bias * context_weight, context, weight)
        if deferred.token_input is not None:  # the token term: its per-token input mixed like the source's values
            u = deferred.token_input.to(p.dtype).expand(kv_heads, -1, -1)  # [kv_heads, n, token width]
            mixed.add_(torch.bmm(torch.bmm(p[:, :, :n], u), deferred.token_weight.float()))
        if kv > n:
            mixed += torch.bmm(own.to(own_values.dtype), own_values).float()
        out[0, rows] = mixed.view(kv_heads, groups, r, -1).permute(2, 0, 1, 3).reshape(r, q_heads, -1).to(out.dtype)
    return out


def mix_sources(p: torch.Tensor, deferred) -> torch.Tensor:
    """Σ_t p_t x_t for every query row: p [kv_heads, rows, n] (rows of target head j in p[j]) → [kv_heads,
    rows, mix width] in FP32, x_t the source values target head j reads at token t, source layer by layer and
    head by head (`preallocated.ValueMaps`), mixed in the source values' dtype."""
    sources = deferred.sources  # k × [source kv_heads, n, d_s]
    kv_heads, rows, n = p.shape
    weights = p.to(sources[0].dtype)
    if deferred.per_head:  # head j reads source head j: one batched product per source layer
        return torch.cat([torch.bmm(weights, v) for v in sources], dim=-1).float()
    heads = sources[0].shape[0]
    every = weights.reshape(1, kv_heads * rows, n).expand(heads, -1, -1)  # every row against each source head
    mixed = torch.stack([torch.bmm(every, v) for v in sources])  # [k, source kv_heads, kv_heads·rows, d_s]
    return (
        mixed.view(len(sources), heads, kv_heads, rows, -1).permute(2, 3, 0, 1, 4).reshape(kv_heads, rows, -1).float()
    )


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

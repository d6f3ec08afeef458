"""Capture a model's KV cache (and its pre-norm key features), and inject K/V as a cache.

Shapes follow one convention across the suite: `[layers, kv_heads, tokens, head_dim]`
for a whole-model cache of one conversation (the adapter is batch-one).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .arch import head_dim


@dataclass
class Capture:
    keys: torch.Tensor  # [layers, kv_heads, tokens, head_dim], as cached: post k_norm, post RoPE
    values: torch.Tensor  # [layers, kv_heads, tokens, head_dim]
    prenorm: torch.Tensor | None  # [layers, kv_heads, tokens, head_dim], k_proj output (pre k_norm, pre RoPE)
    logits: torch.Tensor  # [tokens or logits_to_keep, vocab] of the captured forward

    @property
    def n_tokens(self) -> int:
        return self.keys.shape[2]


def check_batch(input_ids: torch.Tensor) -> None:
    if input_ids.dim() != 2 or input_ids.shape[0] != 1:
        raise ValueError(
            f"input_ids has shape {tuple(input_ids.shape)}; the adapter is batch-one ([1, tokens]). "
            "Loop over conversations, or accumulate gradients across them."
        )


def _kv_shape(model) -> tuple[int, int]:
    return model.config.num_key_value_heads, head_dim(model.config)


def run_with_cache(model, input_ids: torch.Tensor, cache=None, want_prenorm: bool = False, **kwargs):
    """Forward `input_ids` [1, tokens]; return (output, prenorm list or None)."""
    check_batch(input_ids)
    hooks, prenorm = [], []
    if want_prenorm:
        for layer in model.model.layers:
            hooks.append(layer.self_attn.k_proj.register_forward_hook(lambda _m, _i, out: prenorm.append(out)))
    try:
        out = model(input_ids=input_ids, cache=cache, use_cache=True, **kwargs)
    finally:
        for h in hooks:
            h.remove()
    return out, (prenorm if want_prenorm else None)


def capture(model, input_ids: torch.Tensor, want_prenorm: bool = True, logits_to_keep: int = 0) -> Capture:
    """Prefill `input_ids` [1, tokens] and return the stacked cache and pre-norm keys.

    `logits_to_keep=k` keeps only the last k positions' logits (0 keeps all): at long
    contexts the full [tokens, vocab] logits would dwarf the cache itself.
    """
    out, pre = run_with_cache(model, input_ids, want_prenorm=want_prenorm, logits_to_keep=logits_to_keep)
    kv_heads, head_dim = _kv_shape(model)
    cache = out.cache
    keys = torch.stack([layer.keys[0] for layer in cache.layers])  # [layers, kv_heads, tokens, head_dim]
    values = torch.stack([layer.values[0] for layer in cache.layers])
    prenorm = None
    if pre is not None:
        t = input_ids.shape[1]
        # k_proj output is [1, tokens, kv_heads*head_dim] → [layers, kv_heads, tokens, head_dim]
        prenorm = torch.stack([p[0].view(t, kv_heads, head_dim).transpose(0, 1) for p in pre])
    return Capture(keys, values, prenorm, out.logits[0])


def build_cache(model, keys: torch.Tensor, values: torch.Tensor):
    """A fresh transformers DynamicCache holding keys/values [layers, kv_heads, tokens, head_dim].

    The cache grows as it is used, so build a new one for every run.
    """
    from transformers import DynamicCache

    n_layers = model.config.num_hidden_layers
    if keys.shape != values.shape or keys.dim() != 4 or keys.shape[0] != n_layers:
        raise ValueError(
            f"keys {tuple(keys.shape)} / values {tuple(values.shape)} must both be "
            f"[layers={n_layers}, kv_heads, tokens, head_dim]"
        )
    data = [(keys[i].unsqueeze(0), values[i].unsqueeze(0)) for i in range(n_layers)]  # [1, kv_heads, tokens, head_dim]
    return DynamicCache(ddp_cache_data=data, config=model.config)


def continue_from(model, keys: torch.Tensor, values: torch.Tensor, new_ids: torch.Tensor, **kwargs):
    """Run `new_ids` [1, new] on top of an injected cache; positions continue after the cache."""
    cache = build_cache(model, keys, values)
    out, _ = run_with_cache(model, new_ids, cache=cache, **kwargs)
    return out


def handoff_split(prefix_ids: list[int], reply_ids: list[int]) -> tuple[list[int], list[int], list[int]]:
    """(context, new, targets) for scoring a reply after a handoff.

    The cache that is handed over covers `prefix[:-1]`; the receiving model runs the last
    prefix token and the reply (minus its last token) itself, so that its logits predict
    every reply token, the first one included.
    """
    if len(prefix_ids) < 2 or not reply_ids:
        raise ValueError(f"need a prefix of ≥2 tokens and a non-empty reply (got {len(prefix_ids)} and {len(reply_ids)})")
    return list(prefix_ids[:-1]), [prefix_ids[-1], *reply_ids[:-1]], list(reply_ids)

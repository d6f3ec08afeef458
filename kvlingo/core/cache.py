"""Capture a model's KV cache (and its pre-norm key features), and inject K/V as a cache.

Shapes follow one convention across the suite: `[layers, kv_heads, tokens, head_dim]`
for a whole-model cache of one conversation (the adapter is batch-one).

Two kinds of cache (`CACHE_KINDS`), both on transformers' public cache interface:

- `preallocated` (the default; kvlingo.core.preallocated): two tensors [layers, kv_heads,
  capacity, head_dim] hold the context and leave room for what follows. A translator writes
  the context straight into them, a new turn's K/V go in place after it, and attention reads
  views of the filled part with grouped-query attention that never repeats K/V
  (kvlingo.core.attention); on a CPU a few rows' projections are split across threads
  (kvlingo.core.linear). Logits equal DynamicCache's to rounding. A translation may leave
  the context's values deferred (the source's values plus the head-wise value maps, which
  attention applies to a few query rows instead of every context token).
- `dynamic`: transformers' DynamicCache and sdpa attention, as transformers ships them (each
  step concatenates the whole cache in every layer; attention under a mask repeats K/V for
  every query head).

transformers' StaticCache is not used: it attends over its whole capacity under a mask, and
on CUDA with torch 2.11 it hit a device-side assert for a long prefill followed by a step.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass

import torch

from . import attention, linear
from .arch import head_dim
from .settings import CACHE_KINDS, PARTS, Part  # noqa: F401  (re-exported)


@dataclass
class Capture:
    keys: torch.Tensor  # [layers, kv_heads, tokens, head_dim], as cached: post k_norm, post RoPE
    values: torch.Tensor  # [layers, kv_heads, tokens, head_dim]
    prenorm: torch.Tensor | None  # [layers, kv_heads, tokens, head_dim], k_proj output (pre k_norm, pre RoPE)
    logits: torch.Tensor  # [tokens or logits_to_keep, vocab] of the captured forward
    ids: torch.Tensor | None = None  # [tokens] the captured token ids (None where a capture was built without them)

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


def run_with_cache(
    model,
    input_ids: torch.Tensor,
    cache=None,
    want_prenorm: bool = False,
    kind: str = "preallocated",
    room: int = 0,
    **kwargs,
):
    """Forward `input_ids` [1, tokens]; return (output, prenorm list or None).

    Without a `cache` the forward fills a fresh one of `kind`, with
    `room` free token slots after the input on a preallocated one. The attention follows the
    cache: grouped-query attention on a preallocated cache, the model's own on any other.
    """
    from .preallocated import PreallocatedCache

    check_batch(input_ids)
    if cache is None and kind == "preallocated":
        cache = PreallocatedCache.empty(model, input_ids.shape[1] + room)
    hooks, prenorm = [], []
    if want_prenorm:
        for layer in model.model.layers:
            hooks.append(layer.self_attn.k_proj.register_forward_hook(lambda _m, _i, out: prenorm.append(out)))
    try:
        optimised = isinstance(cache, PreallocatedCache)
        if optimised and cache.deferred:  # the context's values are the source's: the attention maps them
            kwargs = {**kwargs, attention.DEFERRED: cache}
        with (
            attention.using(model, attention.NAME if optimised else None),
            linear.few_rows(model, input_ids.numel()) if optimised else nullcontext(),
        ):
            out = model(input_ids=input_ids, cache=cache, use_cache=True, **kwargs)
    finally:
        for h in hooks:
            h.remove()
    return out, (prenorm if want_prenorm else None)


def capture(
    model, input_ids: torch.Tensor, want_prenorm: bool = True, logits_to_keep: int = 0, kind: str = "preallocated"
) -> Capture:
    """Prefill `input_ids` [1, tokens] and return the stacked cache and pre-norm keys.

    `logits_to_keep=k` keeps only the last k positions' logits (0 keeps all): at long
    contexts the full [tokens, vocab] logits would dwarf the cache itself. A preallocated
    cache (sized to the input) is returned as is, without stacking its layers again.
    """
    from .preallocated import PreallocatedCache

    out, pre = run_with_cache(model, input_ids, want_prenorm=want_prenorm, logits_to_keep=logits_to_keep, kind=kind)
    kv_heads, head_dim = _kv_shape(model)
    cache = out.cache
    if isinstance(cache, PreallocatedCache):
        keys, values = cache.context(cache.length)  # [layers, kv_heads, tokens, head_dim]
    else:
        keys = torch.stack([layer.keys[0] for layer in cache.layers])  # [layers, kv_heads, tokens, head_dim]
        values = torch.stack([layer.values[0] for layer in cache.layers])
    prenorm = None
    if pre is not None:
        t = input_ids.shape[1]
        # k_proj output is [1, tokens, kv_heads*head_dim] → [layers, kv_heads, tokens, head_dim]
        prenorm = torch.stack([p[0].view(t, kv_heads, head_dim).transpose(0, 1) for p in pre])
    return Capture(keys, values, prenorm, out.logits[0], input_ids[0])


def build_cache(model, keys: torch.Tensor, values: torch.Tensor, kind: str = "preallocated", room: int = 0):
    """A fresh cache of `kind` holding keys/values [layers, kv_heads, tokens, head_dim].

    `preallocated`: the K/V copied once into buffers with `room` free token slots after them
    (a translation writes into `empty_cache(...).context` instead and skips the copy).
    `dynamic`: a transformers DynamicCache wrapping them. With gradients flowing into keys or
    values (distillation) it is always a DynamicCache: its concatenation is differentiable and
    its copies are small next to a backward pass. Either grows as it is used, so build a new
    one for every run.
    """
    n_layers = model.config.num_hidden_layers
    if keys.shape != values.shape or keys.dim() != 4 or keys.shape[0] != n_layers:
        raise ValueError(
            f"keys {tuple(keys.shape)} / values {tuple(values.shape)} must both be "
            f"[layers={n_layers}, kv_heads, tokens, head_dim]"
        )
    if kind not in CACHE_KINDS:
        raise ValueError(f"cache kind {kind!r} is not one of {CACHE_KINDS}")
    differentiable = torch.is_grad_enabled() and (keys.requires_grad or values.requires_grad)
    if kind == "preallocated" and not differentiable:
        cache = empty_cache(model, keys.shape[2], room, keys.dtype, keys.device)
        k, v = cache.context(keys.shape[2])
        k.copy_(keys)
        v.copy_(values)
        cache.set_length(keys.shape[2])
        return cache
    from transformers import DynamicCache

    data = [(keys[i].unsqueeze(0), values[i].unsqueeze(0)) for i in range(n_layers)]  # [1, kv_heads, tokens, head_dim]
    return DynamicCache(ddp_cache_data=data, config=model.config)


def empty_cache(model, n_context: int, room: int = 0, dtype: torch.dtype | None = None, device=None):
    """An unfilled preallocated cache for `n_context` context tokens plus `room` more: write the
    context into `.context(n_context)`, then `.set_length(n_context)`."""
    from .preallocated import PreallocatedCache

    return PreallocatedCache.empty(model, n_context + room, dtype, device)


def continue_from(
    model, keys: torch.Tensor, values: torch.Tensor, new_ids: torch.Tensor, kind: str = "preallocated", **kwargs
):
    """Run `new_ids` [1, new] on top of an injected cache; positions continue after the cache."""
    cache = build_cache(model, keys, values, kind, room=new_ids.shape[1])
    out, _ = run_with_cache(model, new_ids, cache=cache, **kwargs)
    return out


def handoff_split(prefix_ids: list[int], reply_ids: list[int]) -> tuple[list[int], list[int], list[int]]:
    """(context, new, targets) for scoring a reply after a handoff.

    The cache that is handed over covers `prefix[:-1]`; the receiving model runs the last
    prefix token and the reply (minus its last token) itself, so that its logits predict
    every reply token, the first one included.
    """
    if len(prefix_ids) < 2 or not reply_ids:
        raise ValueError(
            f"need a prefix of ≥2 tokens and a non-empty reply (got {len(prefix_ids)} and {len(reply_ids)})"
        )
    return list(prefix_ids[:-1]), [prefix_ids[-1], *reply_ids[:-1]], list(reply_ids)

"""Attention weighting of the closed-form fit: weigh each context position by how much the
scored reply positions of the native target attend to it.

The positions the handed-over cache holds (context = prefix[:-1], see `cache.handoff_split`)
are weighted by how much the scored positions (new = prefix[-1] + reply[:-1], whose logits
predict the reply) attend to them in the native target reading the real conversation. For
block (layer l, KV head h) and context position j:
    a[l,h,j] = mean over scored query positions i and over the query heads of KV group h
               of softmax_{j' ≤ i}(q_i · k_j' · scaling)[j]
    w[l,h,j] = a[l,h,j] / mean_j' a[l,h,j']      (mean 1 over the context, per block and conversation)
The last prefix token and the reply positions are never read from a handed-over cache in
this split, so no attention measures them; they weigh 1, the context average.

The probabilities are computed here from the target's own pre-RoPE queries (hooked on
q_norm, or on q_proj in families without one; RoPE re-applied in FP32) and its cached keys, only for the scored rows,
in FP32
softmax. That equals eager attention's `output_attentions` (tested against it) without an
eager copy of the target and without materialising [heads, T, T] for every layer, which at a
16k-token prefix would not fit in memory.
"""

from __future__ import annotations

import torch

from ..core import arch
from ..core.cache import Capture, capture
from ..core.rope import RopeCache, apply_rope

FIT_WEIGHTINGS = ("uniform", "attention")


def capture_with_queries(
    model, ids: torch.Tensor, want_prenorm: bool, q_start: int, n_q: int, kind: str = "preallocated"
) -> tuple[Capture, torch.Tensor]:
    """`cache.capture` plus each layer's pre-RoPE queries (post q_norm where the family has one) at
    positions q_start..q_start+n_q-1.

    Returns (capture, queries [layers, q_heads, n_q, head_dim]).
    """
    rows: list[torch.Tensor] = []
    d = arch.head_dim(model.config)
    # The hooked output is [1, tokens, q_heads, head_dim] or [1, tokens, q_heads·head_dim]: keep the scored rows.
    hooks = [
        arch.query_module(layer).register_forward_hook(
            lambda _m, _i, out: rows.append(out[0, q_start : q_start + n_q].reshape(n_q, -1, d))
        )
        for layer in model.model.layers
    ]
    try:
        cap = capture(model, ids, want_prenorm=want_prenorm, logits_to_keep=1, kind=kind)
    finally:
        for h in hooks:
            h.remove()
    return cap, torch.stack(rows).transpose(1, 2)


def scored_attention(
    model, keys: torch.Tensor, queries: torch.Tensor, q_start: int, n_keys: int, rope: RopeCache, chunk: int = 256
) -> torch.Tensor:
    """Mean attention probability from the scored queries to each of the first `n_keys` positions.

    keys [layers, kv_heads, tokens, head_dim] (cached: post-norm, post-RoPE);
    queries [layers, q_heads, n_q, head_dim] (pre-RoPE) at positions q_start.. .
    Returns [layers, kv_heads, n_keys] in FP64: averaged over the queries and over the query
    heads that share each KV head (GQA: query head q reads KV head q // group).
    """
    L, n_heads, n_q, d = queries.shape
    kv_heads, T = keys.shape[1], keys.shape[2]
    group = n_heads // kv_heads
    scaling = model.model.layers[0].self_attn.scaling
    cos, sin = rope(q_start + n_q, device=keys.device)
    out = torch.zeros(L, kv_heads, n_keys, dtype=torch.float64)
    with torch.autocast(device_type=keys.device.type, enabled=False):
        for l in range(L):
            k = keys[l].float().repeat_interleave(group, dim=0)  # [q_heads, tokens, head_dim]
            q = apply_rope(queries[l].float(), cos[q_start:], sin[q_start:])  # [q_heads, n_q, head_dim]
            acc = torch.zeros(n_heads, n_keys, dtype=torch.float64, device=keys.device)
            for c0 in range(0, n_q, chunk):
                c1 = min(n_q, c0 + chunk)
                scores = (q[:, c0:c1] @ k.transpose(1, 2)) * scaling  # [q_heads, c, tokens]
                pos = torch.arange(q_start + c0, q_start + c1, device=keys.device)
                future = torch.arange(T, device=keys.device)[None, :] > pos[:, None]  # causal mask [c, tokens]
                p = torch.softmax(scores.masked_fill(future, float("-inf")), dim=-1)
                acc += p[..., :n_keys].sum(1).double()
            out[l] = (acc / n_q).view(kv_heads, group, n_keys).mean(1).cpu()
    return out


def attention_fit_weights(attn: torch.Tensor, n_tokens: int) -> torch.Tensor:
    """attn [layers, kv_heads, n_context] → per-position fit weights [layers, kv_heads, n_tokens].

    Context positions: attention normalised to mean 1 per block; the rest: 1.
    """
    L, H, n_ctx = attn.shape
    w = torch.ones(L, H, n_tokens, dtype=torch.float64)
    w[..., :n_ctx] = attn / attn.mean(-1, keepdim=True).clamp_min(1e-30)
    return w

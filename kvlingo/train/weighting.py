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

The value fit on attention outputs (`VALUE_FITS` "output", `output_rows`) reads the same
probabilities per query instead of averaged: the values are fitted so that what the scored
queries read from the context, Σ_j p_ij v_j, is the native target's, rather than each v_j.
"""

from __future__ import annotations

import torch

from ..core import arch
from ..core.cache import Capture, capture
from ..core.rope import RopeCache, apply_rope

FIT_WEIGHTINGS = ("uniform", "attention")
VALUE_FITS = ("values", "output")  # the value maps fitted to the raw values, or to the attention output


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


def _scored_probabilities(model, keys: torch.Tensor, queries: torch.Tensor, q_start: int, rope: RopeCache, chunk: int):
    """Yield (layer, first scored row, p [q_heads, rows, tokens] FP32): the scored queries' causal attention
    probabilities, `chunk` query rows at a time (shapes as `scored_attention`'s)."""
    L, n_heads, n_q, d = queries.shape
    kv_heads, T = keys.shape[1], keys.shape[2]
    group = n_heads // kv_heads
    scaling = model.model.layers[0].self_attn.scaling
    cos, sin = rope(q_start + n_q, device=keys.device)
    with torch.autocast(device_type=keys.device.type, enabled=False):
        for l in range(L):
            k = keys[l].float().repeat_interleave(group, dim=0)  # [q_heads, tokens, head_dim]
            q = apply_rope(queries[l].float(), cos[q_start:], sin[q_start:])  # [q_heads, n_q, head_dim]
            for c0 in range(0, n_q, chunk):
                c1 = min(n_q, c0 + chunk)
                scores = (q[:, c0:c1] @ k.transpose(1, 2)) * scaling  # [q_heads, c, tokens]
                pos = torch.arange(q_start + c0, q_start + c1, device=keys.device)
                future = torch.arange(T, device=keys.device)[None, :] > pos[:, None]  # causal mask [c, tokens]
                yield l, c0, torch.softmax(scores.masked_fill(future, float("-inf")), dim=-1)


def scored_attention(
    model, keys: torch.Tensor, queries: torch.Tensor, q_start: int, n_keys: int, rope: RopeCache, chunk: int = 256
) -> torch.Tensor:
    """Mean attention probability from the scored queries to each of the first `n_keys` positions.

    keys [layers, kv_heads, tokens, head_dim] (cached: post-norm, post-RoPE);
    queries [layers, q_heads, n_q, head_dim] (pre-RoPE) at positions q_start.. .
    Returns [layers, kv_heads, n_keys] in FP64: averaged over the queries and over the query
    heads that share each KV head (GQA: query head q reads KV head q // group).
    """
    L, n_heads, n_q, _ = queries.shape
    kv_heads = keys.shape[1]
    acc = torch.zeros(L, n_heads, n_keys, dtype=torch.float64, device=keys.device)
    for l, _, p in _scored_probabilities(model, keys, queries, q_start, rope, chunk):
        acc[l] += p[..., :n_keys].sum(1).double()
    return (acc / n_q).view(L, kv_heads, n_heads // kv_heads, n_keys).mean(2).cpu()


def output_rows(
    model,
    keys: torch.Tensor,
    queries: torch.Tensor,
    q_start: int,
    n_ctx: int,
    rope: RopeCache,
    x: torch.Tensor,
    y: torch.Tensor,
    chunk: int = 256,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The value fit's rows on attention outputs: one per scored query and query head, in its KV head's block.

    For block (layer l, KV head h), query head q of h's group and scored query i, with p the native
    probabilities, m = Σ_{j<n_ctx} p_ij the share of the query's attention on the context and p̄ = p / m:
        row  z = Σ_{j<n_ctx} p̄_ij x_j      target  ȳ = Σ_{j<n_ctx} p̄_ij y_j      weight m²
    so that Σ_rows m² |[z, 1] W̃ − ȳ|² = Σ |Σ_j p_ij ([x_j, 1] W̃ − y_j)|², the error of what the query reads
    from the context (the bias column stays 1, as Σ_j p̄_ij = 1). A query with no weight on the context weighs 0.

    x [layers, kv_heads, tokens, d_in] (the design, one block per KV head), y [layers, kv_heads, tokens, d_out].
    Returns (z [layers, kv_heads, group · n_q, d_in], ȳ [..., d_out], weights [layers, kv_heads, group · n_q]),
    FP64 on x's device.
    """
    L, n_heads, n_q, _ = queries.shape
    kv_heads = keys.shape[1]
    if x.shape[:2] != (L, kv_heads) or y.shape[:2] != (L, kv_heads):
        raise ValueError(
            f"the attention-output value fit needs one fit block per target layer and KV head ({L} × {kv_heads}); "
            f"this translator fits {tuple(x.shape[:2])} blocks: use a head-wise base (headwise, or tokeninput on "
            "--base headwise), or --value-fit values"
        )
    group = n_heads // kv_heads
    xc, yc = x[:, :, :n_ctx].double(), y[:, :, :n_ctx].double()
    z = torch.zeros(L, n_heads, n_q, x.shape[-1], dtype=torch.float64, device=x.device)
    t = torch.zeros(L, n_heads, n_q, y.shape[-1], dtype=torch.float64, device=x.device)
    mass = torch.zeros(L, n_heads, n_q, dtype=torch.float64, device=x.device)
    heads = torch.arange(n_heads, device=x.device) // group  # query head → its KV head
    for l, c0, p in _scored_probabilities(model, keys, queries, q_start, rope, chunk):
        pc = p[..., :n_ctx].double().to(x.device)  # [q_heads, c, n_ctx]
        m = pc.sum(-1)  # [q_heads, c]
        pbar = pc / m.clamp_min(1e-300)[..., None]
        c1 = c0 + pc.shape[1]
        z[l, :, c0:c1] = pbar @ xc[l, heads]
        t[l, :, c0:c1] = pbar @ yc[l, heads]
        mass[l, :, c0:c1] = m
    shape = (L, kv_heads, group * n_q)
    return z.view(*shape, -1), t.view(*shape, -1), mass.pow(2).view(shape)


def attention_fit_weights(attn: torch.Tensor, n_tokens: int) -> torch.Tensor:
    """attn [layers, kv_heads, n_context] → per-position fit weights [layers, kv_heads, n_tokens].

    Context positions: attention normalised to mean 1 per block; the rest: 1.
    """
    L, H, n_ctx = attn.shape
    w = torch.ones(L, H, n_tokens, dtype=torch.float64)
    w[..., :n_ctx] = attn / attn.mean(-1, keepdim=True).clamp_min(1e-30)
    return w

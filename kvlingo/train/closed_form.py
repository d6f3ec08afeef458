"""The closed-form fit of a linear translator family over conversations, in FP64.

Tokens. Source and target each read one whole conversation (prefix + reply) in a single
forward pass, so both caches hold the same tokens at the same positions, and every
position is one training pair. Inputs: the family's design (`design`: its source
features per least-squares block); outputs: the target's key features in the family's key
space (`KeySpace.target_keys`) and its values, laid out per block (`block_targets`).
Reply positions are kept: a later turn hands over a cache that holds earlier replies, and
they double the tokens per conversation.

Weighting "uniform": every position weighs 1. "attention": see `weighting.py`.

The normal equations stream (kvlingo.core.fit): memory is independent of the number of
tokens, and the solve is one batched FP64 call over every block. Under data parallelism each
rank accumulates its share of the conversations and the ranks' FP64 sums are added before the
solve (`distributed.World.sum_normal_equations`), so the fit is the single process's.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from ..core.cache import capture
from ..core.fit import NormalEquations
from ..core.handoff import as_ids
from ..core.translator import Translator
from .distributed import SINGLE, World
from .weighting import FIT_WEIGHTINGS, attention_fit_weights, capture_with_queries, scored_attention


def normal_equations(source, target, translator: Translator, rows: list[dict], weighting: str = "uniform",
                     progress: Callable | None = None) -> NormalEquations:
    """The FP64 normal equations of `translator`'s least-squares blocks over `rows` (not yet solved)."""
    if weighting not in FIT_WEIGHTINGS:
        raise ValueError(f"fit weighting {weighting!r} is not one of {FIT_WEIGHTINGS}")
    device = next(source.parameters()).device
    space = translator.space
    L, B, d_in, d_out = translator.fit_blocks()
    ne = NormalEquations(L, B, d_in, d_out, device="cuda" if device.type == "cuda" else "cpu")
    prenorm = translator.needs_prenorm
    for row in (progress(rows) if progress else rows):
        prefix, reply = row["prefix_ids"], row["reply_ids"]
        ids = as_ids(prefix + reply, device)  # [1, tokens]
        with torch.no_grad():
            src = capture(source, ids, want_prenorm=prenorm, logits_to_keep=1)
            if weighting == "attention":
                n_ctx = len(prefix) - 1  # handoff_split: the cache holds prefix[:-1], the target scores from prefix[-1]
                tgt, queries = capture_with_queries(target, ids, prenorm, q_start=n_ctx, n_q=len(reply))
                attn = scored_attention(target, tgt.keys, queries, n_ctx, n_ctx, space.target_rope)
                weights = attention_fit_weights(attn, ids.shape[1])  # [layers, kv_heads, tokens]
            else:
                tgt, weights = capture(target, ids, want_prenorm=prenorm, logits_to_keep=1), None
            w = translator.block_weights(weights)
            ne.update(0, translator.design(0, src), translator.block_targets(space.target_keys(tgt)), w)
            ne.update(1, translator.design(1, src), translator.block_targets(tgt.values), w)
    return ne


def fit_closed_form(source, target, translator: Translator, rows: list[dict], weighting: str = "uniform",
                    ridge: float = 0.0, progress: Callable | None = None, world: World = SINGLE) -> dict[str, Any]:
    """FP64 least squares of `translator` (bound to source/target) over `rows`, solved into its parameters.

    With a distributed `world`, this rank reads its share of `rows` and the ranks' normal equations
    are summed before the solve. Returns the fit's statistics.
    """
    ne = normal_equations(source, target, translator, world.share(rows), weighting, progress)
    world.sum_normal_equations(ne)
    W, b = ne.solve(ridge)
    translator.set_solution(W, b)
    return {"n_conversations": len(rows), "n_tokens": ne.n_tokens, "family": translator.family,
            "key_space": translator.key_space, "weighting": weighting, "ridge": ridge}

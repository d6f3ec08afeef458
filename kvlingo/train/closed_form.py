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
rank accumulates its share of the conversations (every N-th, by position in the fit list) and
the ranks' FP64 sums are added before the solve (`distributed.World.sum_normal_equations`),
so the fit is the single process's.

Ridge "auto": every `held_out_every`-th fit conversation is held out, each block's ridge is
chosen from `fit.RIDGE_GRID` by its held-out error, and the final solve uses all conversations.
A number fixes λ for every block (0: plain least squares, as the head-wise fit always was).

Families whose layer plan is ranked (cross-layer) first rank source layers per target layer
on the same conversations (`ranking.rank_layers`: a first pass), then fit with that plan.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..core.cache import Part, capture
from ..core.fit import NormalEquations
from ..core.handoff import as_ids
from ..core.translator import LinearFamily
from .distributed import SINGLE, World
from .ranking import rank_layers
from .weighting import FIT_WEIGHTINGS, attention_fit_weights, capture_with_queries, scored_attention


def normal_equations(
    source,
    target,
    translator: LinearFamily,
    rows: list[dict],
    weighting: str = "uniform",
    progress: Callable | None = None,
    kind: str = "preallocated",
) -> NormalEquations:
    """The FP64 normal equations of `translator`'s least-squares blocks over all of `rows` (not yet solved).

    This is one rank's part of the fit: data-parallel callers pass their share of the rows and
    sum the parts (`World.sum_normal_equations`) before solving.
    """
    if weighting not in FIT_WEIGHTINGS:
        raise ValueError(f"fit weighting {weighting!r} is not one of {FIT_WEIGHTINGS}")
    ne = _equations(translator, source)
    for row in progress(rows) if progress else rows:
        _accumulate(ne, source, target, translator, row, weighting, kind)
    return ne


def fit_closed_form(
    source,
    target,
    translator: LinearFamily,
    rows: list[dict],
    weighting: str = "uniform",
    ridge: float | str = 0.0,
    progress: Callable | None = None,
    held_out_every: int = 5,
    world: World = SINGLE,
    kind: str = "preallocated",
) -> dict[str, Any]:
    """FP64 least squares of `translator` (bound to source/target) over `rows`, solved into its parameters.

    `ridge` is λ, or "auto" (chosen per block on held-out conversations). With a distributed
    `world`, this rank reads its share of `rows` and the ranks' sums are added before every solve.
    The captures are prefills on caches of `kind`. Returns the fit's statistics.
    """
    if weighting not in FIT_WEIGHTINGS:
        raise ValueError(f"fit weighting {weighting!r} is not one of {FIT_WEIGHTINGS}")
    if not isinstance(translator, LinearFamily):
        raise ValueError(f"the {translator.family} family has no closed form")
    stats: dict[str, Any] = {
        "n_conversations": len(rows),
        "family": translator.family,
        "key_space": translator.key_space,
        "weighting": weighting,
        "ridge": ridge,
    }
    if translator.needs_plan:
        ranked = rank_layers(source, target, translator, rows, held_out_every, progress, world, kind)
        translator.set_plan(ranked.pop("plan"))
        stats["layer_ranking"] = {**ranked, "plan": translator.plan.tolist()}
    auto = ridge == "auto"
    if auto and len(rows) < 2 * held_out_every:
        raise ValueError(
            f"--ridge auto holds out 1 in {held_out_every} fit conversations and needs at least "
            f"{2 * held_out_every}; got {len(rows)}. Raise --n-fit or pass a number"
        )
    parts = [_equations(translator, source), _equations(translator, source) if auto else None]
    mine = [(i, row) for i, row in enumerate(rows) if i % world.size == world.rank]
    for i, row in progress(mine) if progress else mine:
        part = int(auto and i % held_out_every == held_out_every - 1)
        _accumulate(parts[part], source, target, translator, row, weighting, kind)
    for part in parts:
        if part is not None:
            world.sum_normal_equations(part)
    if auto:
        lam, stats["ridge_choice"] = parts[0].choose_ridge(parts[1])
        ne = parts[0].merged(parts[1])
    else:
        ne, lam = parts[0], float(ridge)
    translator.solve_from(ne, lam)
    stats["n_tokens"] = ne.n_tokens
    return stats


def _equations(translator: LinearFamily, source) -> NormalEquations:
    L, B, d_in, d_out = translator.fit_blocks()
    device = next(source.parameters()).device
    return NormalEquations(L, B, d_in, d_out, device="cuda" if device.type == "cuda" else "cpu")


def _accumulate(
    ne: NormalEquations, source, target, translator: LinearFamily, row: dict, weighting: str, kind: str
) -> None:
    """Add one conversation's tokens (source design, target features, weights) to `ne`."""
    device = next(source.parameters()).device
    space, prenorm = translator.space, translator.needs_prenorm
    prefix, reply = row["prefix_ids"], row["reply_ids"]
    ids = as_ids(prefix + reply, device)  # [1, tokens]
    with torch.no_grad():
        src = capture(source, ids, want_prenorm=prenorm, logits_to_keep=1, kind=kind)
        if weighting == "attention":
            n_ctx = len(prefix) - 1  # handoff_split: the cache holds prefix[:-1], the target scores from prefix[-1]
            tgt, queries = capture_with_queries(target, ids, prenorm, q_start=n_ctx, n_q=len(reply), kind=kind)
            attn = scored_attention(target, tgt.keys, queries, n_ctx, n_ctx, space.target_rope)
            weights = attention_fit_weights(attn, ids.shape[1])  # [layers, kv_heads, tokens]
        else:
            tgt, weights = capture(target, ids, want_prenorm=prenorm, logits_to_keep=1, kind=kind), None
        w = translator.block_weights(weights)
        ne.update(Part.KEYS, translator.design(Part.KEYS, src), translator.block_targets(space.target_keys(tgt)), w)
        ne.update(Part.VALUES, translator.design(Part.VALUES, src), translator.block_targets(tgt.values), w)

"""The closed-form fit of a linear translator family over conversations, in FP64.

Tokens. Source and target each read one whole conversation (prefix + reply) in a single
forward pass, so both caches hold the same tokens at the same positions, and every
position is one training pair. Inputs: the family's design (`design`: its source
features per least-squares block); outputs: the target's key features in the family's key
space (`KeySpace.target_keys`) and its values, laid out per block (`block_targets`).
Reply positions are kept: a later turn hands over a cache that holds earlier replies, and
they double the tokens per conversation.

Weighting "uniform": every position weighs 1. "attention": see `weighting.py`.

Value fit "values": the value maps are fitted to the target's values, position by position, as the
keys are. "output": to what the native target's scored queries read from the context through them,
Σ_j p_ij v_j per query and query head (`weighting.output_rows`), which weighs each value by the
attention it gets and lets errors that the attention averages away cost nothing. The keys are
fitted as before. It needs one fit block per target KV head (head-wise maps, or token input on a
head-wise base).

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
from .weighting import (
    FIT_WEIGHTINGS,
    VALUE_FITS,
    attention_fit_weights,
    capture_with_queries,
    output_rows,
    scored_attention,
)


def normal_equations(
    source,
    target,
    translator: LinearFamily,
    rows: list[dict],
    weighting: str = "uniform",
    progress: Callable | None = None,
    kind: str = "preallocated",
    value_fit: str = "values",
) -> NormalEquations:
    """The FP64 normal equations of `translator`'s least-squares blocks over all of `rows` (not yet solved).

    This is one rank's part of the fit: data-parallel callers pass their share of the rows and
    sum the parts (`World.sum_normal_equations`) before solving.
    """
    _check(weighting, value_fit)
    ne = _equations(translator, source)
    for row in progress(rows) if progress else rows:
        _accumulate(ne, source, target, translator, row, weighting, kind, value_fit)
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
    value_fit: str = "values",
    native_layers: tuple[int, ...] = (),
) -> dict[str, Any]:
    """FP64 least squares of `translator` (bound to source/target) over `rows`, solved into its parameters.

    `ridge` is λ, or "auto" (chosen per block on held-out conversations). With a distributed
    `world`, this rank reads its share of `rows` and the ranks' sums are added before every solve.
    The captures are prefills on caches of `kind`. `value_fit` "output" fits the values to the attention
    output (module docstring). `native_layers`: the target layers the handoff takes from the target itself (exact:0:
    layer 0), which a family that chooses its layers does not choose. Returns the fit's statistics.
    """
    _check(weighting, value_fit)
    if not isinstance(translator, LinearFamily):
        raise ValueError(f"the {translator.family} family has no closed form")
    check_value_fit(translator, value_fit)
    stats: dict[str, Any] = {
        "n_conversations": len(rows),
        "family": translator.family,
        "key_space": translator.key_space,
        "weighting": weighting,
        "ridge": ridge,
        **({"value_fit": value_fit} if value_fit != "values" else {}),
    }
    if translator.needs_plan:
        ranked = rank_layers(source, target, translator, rows, held_out_every, progress, world, kind)
        translator.set_plan(ranked.pop("plan"))
        stats["layer_ranking"] = {**ranked, "plan": translator.plan.tolist()}
    auto = ridge == "auto"
    if translator.chooses_layers and not auto:  # before any work: the choice needs the held-out conversations
        translator.choose_from(None, None, ridge)  # refuses, with the fix
    if auto and len(rows) < 2 * held_out_every:
        raise ValueError(
            f"--ridge auto holds out 1 in {held_out_every} fit conversations and needs at least "
            f"{2 * held_out_every}; got {len(rows)}. Raise --n-fit or pass a number"
        )
    parts = [_equations(translator, source), _equations(translator, source) if auto else None]
    mine = [(i, row) for i, row in enumerate(rows) if i % world.size == world.rank]
    for i, row in progress(mine) if progress else mine:
        part = int(auto and i % held_out_every == held_out_every - 1)
        _accumulate(parts[part], source, target, translator, row, weighting, kind, value_fit)
    for part in parts:
        if part is not None:
            world.sum_normal_equations(part)
    if auto:
        lam, stats["ridge_choice"] = parts[0].choose_ridge(parts[1])
        ne = parts[0].merged(parts[1])
    else:
        ne, lam = parts[0], float(ridge)
    # A family that chooses where its inputs go (token input's chosen layers) chooses on the held-out conversations,
    # solving on the others at the ridge's same relative strength.
    fit_lam = (
        lam * parts[0].input_scale() / ne.input_scale().clamp_min(torch.finfo(torch.float64).tiny) if auto else lam
    )
    choice = translator.choose_from(parts[0], parts[1], fit_lam, native_layers)
    if choice is not None:
        stats["layer_choice"] = choice
    translator.solve_from(ne, lam)
    stats["n_tokens"] = ne.n_tokens
    return stats


def _check(weighting: str, value_fit: str) -> None:
    if weighting not in FIT_WEIGHTINGS:
        raise ValueError(f"fit weighting {weighting!r} is not one of {FIT_WEIGHTINGS}")
    if value_fit not in VALUE_FITS:
        raise ValueError(f"value fit {value_fit!r} is not one of {VALUE_FITS}")


def check_value_fit(translator: LinearFamily, value_fit: str) -> None:
    """Refuses the attention-output value fit for a translator without one fit block per target layer and KV head
    (what the target's queries read is a sum over one KV head's positions)."""
    if value_fit != "output":
        return
    L, B, _, d_out = translator.fit_blocks()
    g = translator.geometry
    if (L, B, d_out) != (g.target_layers, g.target_kv_heads, g.target_head_dim):
        raise ValueError(
            f"the attention-output value fit needs one fit block per target layer and KV head "
            f"({g.target_layers} × {g.target_kv_heads} of width {g.target_head_dim}); the {translator.family} "
            f"maps fit {L} × {B} of width {d_out}: use a head-wise base (--family headwise, or tokeninput with "
            "--base headwise), or --value-fit values"
        )


def _equations(translator: LinearFamily, source) -> NormalEquations:
    L, B, d_in, d_out = translator.fit_blocks()
    device = next(source.parameters()).device
    return NormalEquations(L, B, d_in, d_out, device="cuda" if device.type == "cuda" else "cpu")


def _accumulate(
    ne: NormalEquations,
    source,
    target,
    translator: LinearFamily,
    row: dict,
    weighting: str,
    kind: str,
    value_fit: str = "values",
) -> None:
    """Add one conversation's tokens (source design, target features, weights) to `ne`."""
    device = next(source.parameters()).device
    space, prenorm = translator.space, translator.needs_prenorm
    prefix, reply = row["prefix_ids"], row["reply_ids"]
    ids = as_ids(prefix + reply, device)  # [1, tokens]
    n_ctx = len(prefix) - 1  # handoff_split: the cache holds prefix[:-1], the target scores from prefix[-1]
    with torch.no_grad():
        src = capture(source, ids, want_prenorm=prenorm, logits_to_keep=1, kind=kind)
        weights = queries = None
        if weighting == "attention" or value_fit == "output":
            tgt, queries = capture_with_queries(target, ids, prenorm, q_start=n_ctx, n_q=len(reply), kind=kind)
        else:
            tgt = capture(target, ids, want_prenorm=prenorm, logits_to_keep=1, kind=kind)
        if weighting == "attention":
            attn = scored_attention(target, tgt.keys, queries, n_ctx, n_ctx, space.target_rope)
            weights = attention_fit_weights(attn, ids.shape[1])  # [layers, kv_heads, tokens]
        w = translator.block_weights(weights)
        ne.update(Part.KEYS, translator.design(Part.KEYS, src), translator.block_targets(space.target_keys(tgt)), w)
        x, y = translator.design(Part.VALUES, src), translator.block_targets(tgt.values)
        if value_fit == "output":
            x, y, w = output_rows(target, tgt.keys, queries, n_ctx, n_ctx, space.target_rope, x, y)
        ne.update(Part.VALUES, x, y, w)

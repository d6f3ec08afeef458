"""Which source layers should feed each target layer: held-out R² of single-layer ridge fits.

For every (source layer s, target layer t) and K/V, a ridge map from all of s's KV heads to
all of t's KV heads is fitted on the fit conversations and scored on held-out ones (every
`held_out_every`-th fit conversation), from streamed FP64 sufficient statistics only:

    A_s = Σ x̃ x̃ᵀ (per source layer),  B_st = Σ x̃ yᵀ,  Y_t = Σ |y|²   (fit and held-out parts)
    W_st = (A_s + λ I)⁻¹ B_st,   SSE = tr(WᵀA'W) − 2 tr(WᵀB') + Y',   SST = Y' − |Σy'|²/n'
    R²_st = 1 − SSE / SST

Positions weigh uniformly here (a per-target-layer weighting would need one A per pair). When
the target's features are wider than `proj_dim`, they are projected by a fixed Gaussian matrix
first: a random projection keeps the ratio of explained to total variance in expectation,
which is all a ranking needs, and it bounds the memory of B at L_s·L_t·(d_in+1)·proj_dim.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..core.cache import capture
from ..core.handoff import as_ids

RANK_RIDGE = 1e-3  # relative ridge of the ranking fits (times the mean input energy)


class LayerStats:
    def __init__(self, n_source: int, d_in: int, n_target: int, d_out: int, proj_dim: int = 128, seed: int = 0):
        self.proj = None
        if d_out > proj_dim:
            gen = torch.Generator().manual_seed(seed)
            self.proj = torch.randn(d_out, proj_dim, generator=gen, dtype=torch.float64) / proj_dim**0.5
        p = proj_dim if self.proj is not None else d_out
        self.A = torch.zeros(2, 2, n_source, d_in + 1, d_in + 1, dtype=torch.float64)  # [part, K/V, s, ...]
        self.B = torch.zeros(2, 2, n_source, n_target, d_in + 1, p, dtype=torch.float64)
        self.Y = torch.zeros(2, 2, n_target, dtype=torch.float64)

    def update(self, part: int, which: int, x: torch.Tensor, y: torch.Tensor) -> None:
        """x [L_s, tokens, d_in] (heads concatenated), y [L_t, tokens, d_out], for the fit (0) or held-out (1) part."""
        x = x.detach().cpu().double()
        y = y.detach().cpu().double()
        if self.proj is not None:
            y = y @ self.proj
        xa = torch.cat([x, torch.ones_like(x[..., :1])], -1)  # [L_s, T, d_in+1]
        self.A[part, which] += xa.transpose(-1, -2) @ xa
        self.B[part, which] += torch.einsum("stk,uto->suko", xa, y)
        self.Y[part, which] += y.pow(2).sum((-2, -1))

    def r2(self) -> torch.Tensor:
        """Held-out R² [2 (K/V), L_s, L_t]."""
        A, B = self.A[0], self.B[0]
        d = A.shape[-1] - 1
        scale = torch.diagonal(A, dim1=-2, dim2=-1)[..., :-1].sum(-1) / d  # [2, L_s]
        reg = torch.ones(d + 1, dtype=torch.float64)
        reg[-1] = 0.0
        W = torch.linalg.solve((A + RANK_RIDGE * scale[..., None, None] * torch.diag(reg))[:, :, None], B)
        Ah, Bh, Yh = self.A[1][:, :, None], self.B[1], self.Y[1][:, None, :]  # broadcast over s and t
        sse = (W * (Ah @ W)).sum((-2, -1)) - 2 * (W * Bh).sum((-2, -1)) + Yh
        n = self.A[1][:, 0, -1, -1]  # held-out tokens [2]
        mean_sq = Bh[..., -1, :].pow(2).sum(-1) / n[:, None, None]  # |Σy|²/n, [2, L_s, L_t]
        return 1 - sse / (Yh - mean_sq)


def rank_layers(
    source,
    target,
    translator,
    rows: list[dict],
    held_out_every: int = 5,
    progress: Callable | None = None,
    world=None,
    kind: str = "preallocated",
) -> dict:
    """Rank source layers per target layer by held-out R²; returns {"plan": [2, L_t, k], "r2": [2, L_s, L_t], ...}.

    With a distributed `world` (kvlingo.train.distributed), each rank reads every N-th conversation and
    the statistics are summed across ranks (held-out conversations chosen by position, as in one process).
    """
    if len(rows) < 2 * held_out_every:
        raise ValueError(
            f"ranking source layers needs at least {2 * held_out_every} fit conversations "
            f"(1 in {held_out_every} is held out); got {len(rows)}. Raise --n-fit"
        )
    g, space, k = translator.geometry, translator.space, translator.k
    stats = LayerStats(
        g.source_layers, g.source_kv_heads * g.source_head_dim, g.target_layers, g.target_kv_heads * g.target_head_dim
    )
    device = next(source.parameters()).device
    size, rank = (world.size, world.rank) if world is not None else (1, 0)
    mine = [(i, row) for i, row in enumerate(rows) if i % size == rank]
    for i, row in progress(mine) if progress else mine:
        ids = as_ids(row["prefix_ids"] + row["reply_ids"], device)
        with torch.no_grad():
            src = capture(source, ids, want_prenorm=translator.needs_prenorm, logits_to_keep=1, kind=kind)
            tgt = capture(target, ids, want_prenorm=translator.needs_prenorm, logits_to_keep=1, kind=kind)
            part = int(i % held_out_every == held_out_every - 1)
            for which, (x, y) in enumerate(
                ((space.source_keys(src), space.target_keys(tgt)), (src.values.float(), tgt.values.float()))
            ):
                stats.update(part, which, _heads_last(x), _heads_last(y))
    if world is not None and world.distributed:
        for t in (stats.A, stats.B, stats.Y):
            world.sum_(t)
    r2 = stats.r2()  # [2, L_s, L_t]
    top = r2.transpose(1, 2).topk(k, dim=-1).indices  # [2, L_t, k], best first
    plan = top.sort(dim=-1).values  # concatenated in layer order
    return {
        "plan": plan,
        "r2": r2.tolist(),
        "held_out_every": held_out_every,
        "projected_to": None if stats.proj is None else stats.proj.shape[1],
    }


def _heads_last(x: torch.Tensor) -> torch.Tensor:
    """[layers, heads, tokens, dim] → [layers, tokens, heads·dim]."""
    L, H, T, d = x.shape
    return x.transpose(1, 2).reshape(L, T, H * d)

"""The FP64 closed-form fit against torch.linalg.lstsq."""

from __future__ import annotations

import torch

from kvlingo.core.fit import NormalEquations


def _reference(x, y, w=None, ridge=0.0):
    """Per-block lstsq on [x, 1] (rows scaled by √w), with ridge as extra rows: the textbook route."""
    L, H, T, d = x.shape
    out = torch.zeros(L, H, d + 1, y.shape[-1], dtype=torch.float64)
    for l in range(L):
        for h in range(H):
            a = torch.cat([x[l, h], torch.ones(T, 1, dtype=torch.float64)], 1)
            b = y[l, h]
            if w is not None:
                s = w[l, h].sqrt()[:, None]
                a, b = a * s, b * s
            if ridge:
                reg = torch.eye(d + 1, dtype=torch.float64)[:d] * ridge**0.5
                a, b = torch.cat([a, reg]), torch.cat([b, torch.zeros(d, b.shape[1], dtype=torch.float64)])
            out[l, h] = torch.linalg.lstsq(a, b).solution
    return out


def _data(seed=0, L=2, H=3, T=400, d=6, noise=0.1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(L, H, T, d, generator=g, dtype=torch.float64)
    W = torch.randn(L, H, d, d, generator=g, dtype=torch.float64)
    b = torch.randn(L, H, d, generator=g, dtype=torch.float64)
    y = x @ W + b[:, :, None] + noise * torch.randn(L, H, T, d, generator=g, dtype=torch.float64)
    return x, y, W, b


def _rel(a, b):
    return ((a - b).norm() / b.norm()).item()


def test_streamed_fit_matches_lstsq():
    x, y, _, _ = _data()
    ne = NormalEquations(2, 3, 6, 6)
    for chunk in range(4):  # streamed in four pieces
        sl = slice(chunk * 100, (chunk + 1) * 100)
        ne.update(0, x[:, :, sl], y[:, :, sl])
        ne.update(1, x[:, :, sl].float(), y[:, :, sl].float())  # FP32 inputs still accumulate in FP64
    W, b = ne.solve()
    ref = _reference(x, y)
    assert _rel(torch.cat([W[0], b[0][..., None, :]], -2), ref) < 1e-10
    assert ne.A.dtype == torch.float64 and ne.n_tokens == 400
    ref32 = _reference(x.float().double(), y.float().double())
    assert _rel(torch.cat([W[1], b[1][..., None, :]], -2), ref32) < 1e-10


def test_fit_recovers_planted_relation():
    x, y, W_true, b_true = _data(noise=0.0)
    ne = NormalEquations(2, 3, 6, 6)
    ne.update(0, x, y)
    ne.update(1, x, y)
    W, b = ne.solve()
    assert (W[0] - W_true).abs().max().item() < 1e-9 and (b[0] - b_true).abs().max().item() < 1e-9


def test_weighted_and_ridge_fit_match_lstsq():
    x, y, _, _ = _data(seed=1)
    w = torch.rand(2, 3, 400, generator=torch.Generator().manual_seed(5), dtype=torch.float64) + 0.05
    ne = NormalEquations(2, 3, 6, 6)
    ne.update(0, x, y, weights=w)
    ne.update(1, x, y, weights=w)
    W, b = ne.solve(ridge=3.0)
    ref = _reference(x, y, w=w, ridge=3.0)
    assert _rel(torch.cat([W[0], b[0][..., None, :]], -2), ref) < 1e-10
    # ridge really shrinks, and uniform weights equal no weights
    W0, _ = ne.solve(ridge=0.0)
    assert W[0].norm() < W0[0].norm()
    ne2 = NormalEquations(2, 3, 6, 6)
    ne2.update(0, x, y, weights=torch.ones(400, dtype=torch.float64))
    ne3 = NormalEquations(2, 3, 6, 6)
    ne3.update(0, x, y)
    assert torch.equal(ne2.A, ne3.A)


def test_rank_deficient_block_falls_back_to_min_norm():
    x = torch.zeros(1, 1, 10, 3, dtype=torch.float64)
    x[..., 0] = torch.arange(10.0)
    y = 2 * x[..., :1].repeat(1, 1, 1, 3)
    ne = NormalEquations(1, 1, 3, 3)
    ne.update(0, x, y)
    ne.update(1, x, y)
    W, b = ne.solve()
    assert torch.isfinite(W).all()
    pred = x @ W[0] + b[0][:, :, None]
    assert (pred - y).abs().max().item() < 1e-8

"""The FP64 closed-form fit (kvlingo/core/fit.py) against torch.linalg.lstsq, alone and through every linear
family's design."""

from __future__ import annotations

import pytest
import torch
from refs import fake_capture, lstsq_blocks

from kvlingo.core.cache import Capture
from kvlingo.core.families.crosslayer.maps import CrossHead, CrossLayer
from kvlingo.core.families.headwise.maps import Headwise
from kvlingo.core.fit import NormalEquations
from kvlingo.core.translator import Geometry

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: one torch thread per module


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


GEOM = Geometry(
    source_layers=4, source_kv_heads=2, source_head_dim=8, target_layers=3, target_kv_heads=3, target_head_dim=4
)


@pytest.mark.parametrize(
    "make",
    [
        lambda: CrossHead(GEOM, rank=0),
        lambda: CrossLayer(GEOM, k=2, pairing="proportional"),
        lambda: Headwise(Geometry(3, 2, 8, 3, 2, 4)),
    ],
)
@pytest.mark.parametrize("weighted,ridge", [(False, 0.0), (True, 0.0), (True, 0.7)])
def test_linear_closed_forms_match_lstsq(make, weighted, ridge):
    tr = make()
    g = tr.geometry
    cap = fake_capture(g, 300)
    L, B, d_in, d_out = tr.fit_blocks()
    gen = torch.Generator().manual_seed(1)
    ne = NormalEquations(L, B, d_in, d_out)
    xs = []
    x = tr.design(1, cap).double()  # the values' design (keys differ only by the key space, tested elsewhere)
    for which in (0, 1):
        W = torch.randn(L, B, d_in, d_out, generator=gen, dtype=torch.float64)
        y = x @ W + 0.05 * torch.randn(*x.shape[:3], d_out, generator=gen, dtype=torch.float64)
        w = torch.rand(L, B, 300, generator=gen, dtype=torch.float64) + 0.2 if weighted else None
        ne.update(which, x, y, w)
        xs.append((x, y, w))
    tr.solve_from(ne, ridge)
    for which, (x, y, w) in enumerate(xs):
        ref = lstsq_blocks(x, y, w, ridge)
        got = _augmented(tr, which).double()  # [L, B, d_in+1, d_out] from the parameters
        assert ((got - ref).norm() / ref.norm()).item() < 1e-6  # parameters are FP32: one rounding
    # and the translation uses the parameters as the design says: map(x) = x̃ᵀW̃, block by block
    got = _augmented(tr, 1).double()
    pred = torch.einsum("lbtd,lbdo->lbto", torch.cat([x, torch.ones_like(x[..., :1])], -1), got)
    out = tr.map(1, _capture_for(tr, cap), slice(None)).double()  # [L, H_t, T, d_t]
    assert (tr.block_targets(out) - pred).abs().max().item() < 1e-4


def _capture_for(tr, cap):
    return Capture(cap.prenorm.float(), cap.values.float(), cap.prenorm.float(), cap.logits)


def _augmented(tr, which):
    if isinstance(tr, Headwise):
        return torch.cat([tr.weight[which], tr.bias[which][..., None, :]], -2).detach()
    return torch.cat([tr.weight[which], tr.bias[which][:, None, :]], -2)[:, None].detach()


def test_fit_solves_match_lstsq_in_fp64_to_1e9():
    """The solve itself, before the FP32 parameters: FP64 against lstsq on a planted exact relation."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 1, 200, 12, generator=g, dtype=torch.float64)
    W = torch.randn(2, 1, 12, 5, generator=g, dtype=torch.float64)
    y = x @ W + 0.3
    for w, ridge in ((None, 0.0), (torch.rand(2, 1, 200, generator=g, dtype=torch.float64) + 0.1, 0.5)):
        ne = NormalEquations(2, 1, 12, 5)
        ne.update(0, x, y, w)
        ne.update(1, x, y, w)
        got = ne.solve_augmented(ridge)[0]
        ref = lstsq_blocks(x, y, w, ridge)
        assert ((got - ref).norm() / ref.norm()).item() < 1e-9


def test_a_solution_in_another_basis_is_the_same_solution():
    """`in_basis`: the normal equations of the inputs x̃ T, solved, then mapped back by T, give the direct solution
    (T invertible, the bias column kept)."""
    x, y, _, _ = _data(seed=3)
    ne = NormalEquations(2, 3, 6, 6)
    ne.update(0, x, y)
    ne.update(1, x, y)
    g = torch.Generator().manual_seed(4)
    T = torch.eye(7, dtype=torch.float64)
    T[:6, :6] = torch.randn(6, 6, generator=g, dtype=torch.float64)
    T[:6, 6] = torch.randn(6, generator=g, dtype=torch.float64)  # an input offset in the last column, bias row kept
    moved = ne.in_basis(T)
    assert moved.d_in == 6 and moved.n_tokens == ne.n_tokens and torch.equal(moved.Y, ne.Y)
    assert _rel(T @ moved.solve_augmented(0.0), ne.solve_augmented(0.0)) < 1e-9


def test_inputs_of_lower_rank_are_solved_on_their_span_as_minimum_norm_least_squares():
    """Inputs that are a linear image of 3 dimensions in 8, rounded to FP32 (as a target's layer-0 features are where
    2 · KV width > hidden): solved in an orthonormal basis of that image (`in_basis`), the weights are the
    minimum-norm least-squares solution (reference: torch.linalg.pinv of the inputs), where a plain solve of the full
    equations puts large weights on the directions only rounding reaches."""
    g = torch.Generator().manual_seed(6)
    z = torch.randn(1, 2, 300, 3, generator=g, dtype=torch.float64)
    G = torch.randn(3, 8, generator=g, dtype=torch.float64)
    x = (z @ G).float().double()
    y = z @ torch.randn(3, 4, generator=g, dtype=torch.float64) + 0.1 * torch.randn(1, 2, 300, 4, generator=g)
    ne = NormalEquations(1, 2, 8, 4)
    ne.update(0, x, y)
    ne.update(1, x, y)
    span = torch.linalg.qr(G.T).Q  # [8, 3]: the image's directions
    T = torch.zeros(9, 4, dtype=torch.float64)
    T[:8, :3], T[8, 3] = span, 1.0
    got = T @ ne.in_basis(T).solve_augmented(0.0)  # [2, 1, 2, 9, 4]
    for h in range(2):
        xa = torch.cat([x[0, h], torch.ones(300, 1, dtype=torch.float64)], 1)
        ref = torch.linalg.pinv(xa, rtol=1e-6) @ y[0, h]
        assert _rel(got[1, 0, h], ref) < 1e-6
    plain = ne.solve_augmented(0.0)
    assert plain.abs().max() > 1e3 * got.abs().max()  # what the span prevents

"""Closed-form least squares for linear translators, from streamed normal equations.

For every block (K/V, layer, block within the layer) we accumulate, in FP64 (on the CPU, or
on CUDA when asked: MPS has no FP64):
    A = Σ w_t x̃_t x̃_tᵀ    B = Σ w_t x̃_t y_tᵀ    Y = Σ w_t |y_t|²    with x̃ = [x, 1] (the bias column)
over any number of conversations, then solve (A + λ·diag(1,…,1,0)) [W; b] = B.
Memory is independent of the number of tokens seen.

Ridge. λ is a number, or a tensor with one value per block. `ridge_grid` scales a grid of
relative strengths α by each block's mean input energy (tr A / d, the bias excluded), and
`held_out_error` scores a solution on another set of normal equations, the held-out
positions' (Σ w |x̃ᵀW̃ − y|², from A, B and Y alone), so the ridge can be chosen per block
without keeping a single token.

Reduced rank. `reduced_rank` keeps the rank-r part of a solution that best reproduces its own
fitted values (Σ w |x̃ᵀW̃ − x̃ᵀW̃_r|² minimal): W̃_r = W̃ V V ᵀ with V the top-r eigenvectors of
W̃ᵀ A W̃, returned as the factors (W̃ V, Vᵀ).

Inputs of lower rank than their width. `in_basis` rewrites the normal equations for the inputs x̃ T: with T an
orthonormal basis of the directions the inputs take (beside the bias), the solution mapped back by T is the
minimum-norm least-squares one, with no weight on directions the inputs reach only through rounding.
"""

from __future__ import annotations

import torch

RIDGE_GRID = (0.0, 1e-4, 1e-3, 1e-2, 1e-1, 1.0)  # relative strengths α tried by `--ridge auto`


class NormalEquations:
    def __init__(self, n_layers: int, n_heads: int, d_in: int, d_out: int, device: str = "cpu"):
        if torch.device(device).type == "mps":
            raise ValueError("MPS has no float64: accumulate the normal equations on the CPU (device='cpu')")
        self.d_in = d_in
        self.device = torch.device(device)
        self.A = torch.zeros(2, n_layers, n_heads, d_in + 1, d_in + 1, dtype=torch.float64, device=self.device)
        self.B = torch.zeros(2, n_layers, n_heads, d_in + 1, d_out, dtype=torch.float64, device=self.device)
        self.Y = torch.zeros(2, n_layers, n_heads, dtype=torch.float64, device=self.device)
        self.n_tokens = 0

    def update(self, which: int, x: torch.Tensor, y: torch.Tensor, weights: torch.Tensor | None = None) -> None:
        """Add tokens for keys (0) or values (1).

        x [layers, heads, tokens, d_in], y [layers, heads, tokens, d_out],
        weights broadcastable to [layers, heads, tokens] (per-position weights), or None.
        """
        x = x.detach().to(self.device, torch.float64)
        y = y.detach().to(self.device, torch.float64)
        xa = torch.cat([x, torch.ones_like(x[..., :1])], dim=-1)  # [L, H, T, d_in+1]
        w = None if weights is None else weights.detach().to(self.device, torch.float64).expand(xa.shape[:-1])
        xw = xa if w is None else xa * w[..., None]
        self.A[which] += xw.transpose(-1, -2) @ xa
        self.B[which] += xw.transpose(-1, -2) @ y
        yy = y.pow(2).sum(-1)  # [L, H, T]
        self.Y[which] += (yy if w is None else yy * w).sum(-1)
        if which == 0:
            self.n_tokens += x.shape[2]

    def merged(self, other: NormalEquations) -> NormalEquations:
        """The normal equations of both sets of tokens together."""
        out = NormalEquations(self.A.shape[1], self.A.shape[2], self.d_in, self.B.shape[-1], str(self.device))
        out.A, out.B, out.Y = self.A + other.A, self.B + other.B, self.Y + other.Y
        out.n_tokens = self.n_tokens + other.n_tokens
        return out

    def input_scale(self) -> torch.Tensor:
        """Mean input energy per block, tr(A) / d_in over the features (bias excluded): [2, L, H]."""
        diag = torch.diagonal(self.A, dim1=-2, dim2=-1)[..., :-1]
        return diag.sum(-1).cpu() / self.d_in

    def ridge_grid(self, alphas=RIDGE_GRID) -> list[torch.Tensor]:
        """Per-block λ for each relative strength α."""
        scale = self.input_scale()
        return [alpha * scale for alpha in alphas]

    def solve(self, ridge: float | torch.Tensor = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
        """(weight [2, L, H, d_in, d_out], bias [2, L, H, d_out]) in FP64."""
        sol = self.solve_augmented(ridge)
        return sol[..., :-1, :], sol[..., -1, :]

    def solve_augmented(self, ridge: float | torch.Tensor = 0.0) -> torch.Tensor:
        """[W; b] as one [2, L, H, d_in+1, d_out] FP64 tensor."""
        A = self.A.cpu().clone()  # the solve itself is small: always on the CPU
        B = self.B.cpu()
        reg = torch.ones(self.d_in + 1, dtype=torch.float64)
        reg[-1] = 0.0  # the bias is not shrunk
        lam = torch.as_tensor(ridge, dtype=torch.float64)
        if lam.dim():
            A += lam[..., None, None] * torch.diag(reg)
        elif float(lam):
            A += float(lam) * torch.diag(reg)
        try:
            return torch.linalg.solve(A, B)
        except torch.linalg.LinAlgError:
            # Rank-deficient blocks (too few tokens, dead features): minimum-norm solution instead.
            return torch.linalg.lstsq(A, B, driver="gelsd").solution

    def solve_subset(self, ridge: float | torch.Tensor, keep: list[int]) -> torch.Tensor:
        """The solution on the inputs `keep` alone (indices into the augmented rows, the bias last among them):
        the least-squares problem of those inputs, from the same statistics: [2, L, H, len(keep), d_out] FP64."""
        A = self.A.cpu()[..., keep, :][..., keep].clone()
        B = self.B.cpu()[..., keep, :]
        reg = torch.ones(len(keep), dtype=torch.float64)
        reg[-1] = 0.0  # the bias is not shrunk
        lam = torch.as_tensor(ridge, dtype=torch.float64)
        if lam.dim():
            A += lam[..., None, None] * torch.diag(reg)
        elif float(lam):
            A += float(lam) * torch.diag(reg)
        try:
            return torch.linalg.solve(A, B)
        except torch.linalg.LinAlgError:
            return torch.linalg.lstsq(A, B, driver="gelsd").solution

    def held_out_error(self, augmented: torch.Tensor) -> torch.Tensor:
        """Σ w |x̃ᵀW̃ − y|² over this set's tokens for a solution W̃ [2, L, H, d_in+1, d_out]: [2, L, H]."""
        A, B, W = self.A.cpu(), self.B.cpu(), augmented.to(torch.float64)
        quad = (W * (A @ W)).sum((-2, -1))
        cross = (W * B).sum((-2, -1))
        return quad - 2 * cross + self.Y.cpu()

    def choose_ridge(self, held_out: NormalEquations, alphas=RIDGE_GRID) -> tuple[torch.Tensor, dict]:
        """The per-block relative strength α with the lowest held-out error, as (λ for the merged equations
        [2, L, H], a summary of the choice)."""
        errors = torch.stack([held_out.held_out_error(self.solve_augmented(lam)) for lam in self.ridge_grid(alphas)])
        best = errors.argmin(0)  # [2, L, H] index into alphas
        alpha = torch.tensor(alphas, dtype=torch.float64)[best]
        merged = self.merged(held_out)
        counts = {f"{a:g}": int((best == i).sum()) for i, a in enumerate(alphas)}
        held = errors.gather(0, best[None])[0]
        return alpha * merged.input_scale(), {
            "alphas": list(alphas),
            "blocks_per_alpha": counts,
            "held_out_tokens": held_out.n_tokens,
            "held_out_error": float(held.sum()),
        }

    def in_basis(self, T: torch.Tensor) -> NormalEquations:
        """The same least-squares problem on the inputs x̃ T (T [d_in + 1, d' + 1]; its last column the bias's,
        T's last row (0, …, 0, 1)): A' = Tᵀ A T, B' = Tᵀ B, Y unchanged. A solution W̃' gives W̃ = T W̃'."""
        T = T.to(self.device, torch.float64)
        out = NormalEquations(self.A.shape[1], self.A.shape[2], T.shape[1] - 1, self.B.shape[-1], str(self.device))
        for part in range(2):
            for layer in range(self.A.shape[1]):  # one layer at a time: a temporary of one layer's blocks
                out.A[part, layer] = T.T @ self.A[part, layer] @ T
                out.B[part, layer] = T.T @ self.B[part, layer]
        out.Y, out.n_tokens = self.Y.clone(), self.n_tokens
        return out

    def state_dict(self) -> dict:
        return {"A": self.A, "B": self.B, "Y": self.Y, "n_tokens": self.n_tokens}


def reduced_rank(augmented: torch.Tensor, A: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The best rank-`rank` approximation of the fitted values of W̃ [..., d_in+1, d_out] under A
    [..., d_in+1, d_in+1]: factors (W̃ V [..., d_in+1, r], Vᵀ [..., r, d_out])."""
    M = augmented.transpose(-1, -2) @ A @ augmented  # [..., d_out, d_out]: the fitted values' second moment
    M = 0.5 * (M + M.transpose(-1, -2))
    _, vecs = torch.linalg.eigh(M)  # ascending eigenvalues
    V = vecs[..., -rank:].flip(-1)  # [..., d_out, r]
    return augmented @ V, V.transpose(-1, -2)

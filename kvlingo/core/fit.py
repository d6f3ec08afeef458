"""Closed-form least squares for the head-wise maps, from streamed normal equations.

For every block (K/V, layer, head) we accumulate, in FP64 (on the CPU, or on CUDA when
asked: MPS has no FP64):
    A = Σ w_t x̃_t x̃_tᵀ    B = Σ w_t x̃_t y_tᵀ      with x̃ = [x, 1] (the bias column)
over any number of conversations, then solve (A + λ·diag(1,…,1,0)) [W; b] = B.
Memory is independent of the number of tokens seen.
"""

from __future__ import annotations

import torch


class NormalEquations:
    def __init__(self, n_layers: int, n_heads: int, d_in: int, d_out: int, device: str = "cpu"):
        if torch.device(device).type == "mps":
            raise ValueError("MPS has no float64: accumulate the normal equations on the CPU (device='cpu')")
        self.d_in = d_in
        self.device = torch.device(device)
        self.A = torch.zeros(2, n_layers, n_heads, d_in + 1, d_in + 1, dtype=torch.float64, device=self.device)
        self.B = torch.zeros(2, n_layers, n_heads, d_in + 1, d_out, dtype=torch.float64, device=self.device)
        self.n_tokens = 0

    def update(self, which: int, x: torch.Tensor, y: torch.Tensor, weights: torch.Tensor | None = None) -> None:
        """Add tokens for keys (0) or values (1).

        x [layers, heads, tokens, d_in], y [layers, heads, tokens, d_out],
        weights broadcastable to [layers, heads, tokens] (per-position weights), or None.
        """
        x = x.detach().to(self.device, torch.float64)
        y = y.detach().to(self.device, torch.float64)
        xa = torch.cat([x, torch.ones_like(x[..., :1])], dim=-1)  # [L, H, T, d_in+1]
        xw = xa if weights is None else xa * weights.detach().to(self.device, torch.float64).expand(xa.shape[:-1])[..., None]
        self.A[which] += xw.transpose(-1, -2) @ xa
        self.B[which] += xw.transpose(-1, -2) @ y
        if which == 0:
            self.n_tokens += x.shape[2]

    def solve(self, ridge: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
        """(weight [2, L, H, d_in, d_out], bias [2, L, H, d_out]) in FP64."""
        A = self.A.cpu().clone()  # the solve itself is small: always on the CPU
        B = self.B.cpu()
        if ridge:
            reg = torch.ones(self.d_in + 1, dtype=torch.float64)
            reg[-1] = 0.0  # the bias is not shrunk
            A += ridge * torch.diag(reg)
        try:
            sol = torch.linalg.solve(A, B)
        except torch.linalg.LinAlgError:
            # Rank-deficient blocks (too few tokens, dead features): minimum-norm solution instead.
            sol = torch.linalg.lstsq(A, B, driver="gelsd").solution
        return sol[..., :-1, :], sol[..., -1, :]

    def state_dict(self) -> dict:
        return {"A": self.A, "B": self.B, "n_tokens": self.n_tokens}

"""The head-wise family: one affine map per (K/V, layer, KV head).

    weight [2, layers, kv_heads, d_in, d_out]   (index Part.KEYS, Part.VALUES)
    bias   [2, layers, kv_heads, d_out]

applied to a run of layers and every head at once with one batched matmul per K/V, never
a Python loop over heads. Head h of layer l reads head h of layer l only, so the pair must
have the same layer and KV-head counts; head_dim may differ.

Closed form: every (K/V, layer, head) is its own least-squares block (kvlingo.core.fit).
"""

from __future__ import annotations

import torch
from torch import nn

from ...cache import Capture
from ...preallocated import ValueMaps
from ...translator import Geometry, LinearFamily, Part, TranslatorError


class Headwise(LinearFamily):
    family = "headwise"
    fast_paths = True  # _affine casts its maps, and writes strided outputs through view + baddbmm(out=)

    def __init__(self, geometry: Geometry, key_space: str = "prenorm"):
        super().__init__(geometry, key_space)
        if not geometry.same_layout:
            raise TranslatorError(
                f"head-wise maps pair layer l, head h of the source with layer l, head h of the target, but the "
                f"source has {geometry.source_layers} layers × {geometry.source_kv_heads} KV heads and the target "
                f"{geometry.target_layers} × {geometry.target_kv_heads}; use --family crosslayer (any depths and "
                "head counts) or crosshead (the source layer at the same relative depth)"
            )
        L, H = geometry.target_layers, geometry.target_kv_heads
        self.weight = nn.Parameter(torch.zeros(2, L, H, geometry.source_head_dim, geometry.target_head_dim))
        self.bias = nn.Parameter(torch.zeros(2, L, H, geometry.target_head_dim))

    @classmethod
    def identity(cls, geometry: Geometry, key_space: str = "prenorm") -> Headwise:
        m = cls(geometry, key_space)
        with torch.no_grad():
            m.weight.copy_(torch.eye(geometry.source_head_dim, geometry.target_head_dim).expand_as(m.weight))
        return m

    def flops_per_token(self, part: Part | None = None) -> float:
        g = self.geometry
        one = 2.0 * g.target_layers * g.target_kv_heads * g.source_head_dim * g.target_head_dim  # keys or values
        return one * (2 if part is None else 1)

    def value_maps(self) -> ValueMaps:
        """Head j of layer l reads head j of layer l: the per-head case of `ValueMaps`."""
        layers = tuple((layer,) for layer in range(self.geometry.target_layers))
        return ValueMaps(
            layers, per_head=True, weight=self.weight[Part.VALUES].detach(), bias=self.bias[Part.VALUES].detach()
        )

    # ------------------------------------------------------------------ translation
    def _affine(self, part: Part, x: torch.Tensor, layers: slice, out: torch.Tensor | None) -> torch.Tensor:
        """x [n, heads, tokens, d_in] → [n, heads, tokens, d_out], into `out` when given (x's dtype; contiguous
        within each head, e.g. a cache's context view)."""
        L, H, T, d_in = x.shape
        w = self.cast(self.weight)[part, layers].reshape(L * H, d_in, -1)  # [L*H, d_in, d_out]
        b = self.cast(self.bias)[part, layers].reshape(L * H, 1, -1)  # [L*H, 1, d_out]
        if out is None:
            return torch.baddbmm(b, x.reshape(L * H, T, d_in), w).view(L, H, T, -1)
        torch.baddbmm(b, x.reshape(L * H, T, d_in), w, out=out.view(L * H, T, -1))
        return out

    def map(self, part: Part, cap: Capture, layers: slice) -> torch.Tensor:
        return self._affine(part, self.source(part, cap, layers), layers, None)

    def map_into(self, part: Part, cap: Capture, layers: slice, out: torch.Tensor) -> None:
        self._affine(part, self.source(part, cap, layers), layers, out)

    # ------------------------------------------------------------------ closed form
    def fit_blocks(self) -> tuple[int, int, int, int]:
        g = self.geometry
        return g.target_layers, g.target_kv_heads, g.source_head_dim, g.target_head_dim

    def design(self, part: Part, cap: Capture) -> torch.Tensor:
        return self.source(part, cap)  # [layers, heads, tokens, d_in]: one block per head

    @staticmethod
    def block_targets(y: torch.Tensor) -> torch.Tensor:
        return y  # [layers, heads, tokens, d_out]: one block per head already

    @staticmethod
    def block_weights(w: torch.Tensor | None) -> torch.Tensor | None:
        return w  # [layers, heads, tokens]

    def set_solution(self, weight: torch.Tensor, bias: torch.Tensor) -> None:
        """weight [2, layers, heads, d_in, d_out], bias [2, layers, heads, d_out] (FP64) into the FP32 maps."""
        with torch.no_grad():
            self.weight.copy_(weight.float())
            self.bias.copy_(bias.float())

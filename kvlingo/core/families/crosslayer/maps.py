"""Cross-head and cross-layer families: every target KV head reads every source KV head of some source layers.

For target layer l (and K/V separately), the input is the concatenation over its source layers
s ∈ plan[l] of all source KV heads' features, x_l [tokens, k·H_s·d_s], and the output is all
target KV heads at once, y_l [tokens, H_t·d_t]:

    y_l = x_l W_l + b_l                       (full: W_l [k·H_s·d_s, H_t·d_t])
    y_l = (x_l D_l) U_l + b_l                 (rank r: D_l [k·H_s·d_s, r], U_l [r, H_t·d_t])

`rank` sets the values' map and, unless `key_rank` is given, the keys' (0: full). Keys and
values that share a rank keep one [2, layers, ...] tensor per factor (index Part.KEYS, Part.VALUES); with a
`key_rank` of their own, the keys' factors are `key_*` and the values' `value_*`.

so neither the depths, the KV-head counts nor head_dim need to match. The plan (which source
layers feed each target layer, [2, target layers, k]) is a buffer saved with the state and
recorded in the manifest's settings.

- `crosshead`: k = 1, the source layer at the same relative depth,
  round(l · (L_s − 1) / (L_t − 1)) (the layer itself when the depths match).
- `crosslayer`: the top-k source layers per target layer (and per K/V) by held-out R² of a
  ridge fit on the fit conversations (`kvlingo.train.ranking`), or, with `pairing="proportional"`,
  the k source layers nearest to the same relative depth.

Closed form: one least-squares block per (K/V, target layer), weighted per position by the
mean of the target layer's per-head weights; a rank keeps the reduced-rank solution of the
same normal equations (`fit.reduced_rank`), for keys and values apart.

The values are linear in the source's values, so a handoff may leave them deferred
(`value_maps`, kvlingo.core.preallocated): only the keys are translated.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ...cache import Capture
from ...fit import NormalEquations, reduced_rank
from ...preallocated import ValueMaps
from ...translator import PARTS, Geometry, LinearFamily, Part, TranslatorError
from . import PAIRINGS


def proportional_layers(l_target: int, n_target: int, n_source: int, k: int = 1) -> list[int]:
    """The k source layers nearest to target layer l's relative depth l·(L_s−1)/(L_t−1), nearest first
    (halves round up, so k = 1 gives round-half-up of that depth)."""
    centre = l_target * (n_source - 1) / max(1, n_target - 1)
    order = sorted(range(n_source), key=lambda s: (abs(s - centre), -s))
    return order[:k]


class CrossLayer(LinearFamily):
    family = "crosslayer"
    fast_paths = True  # map casts its parameters; map_into (the base's) copies into strided outputs

    def __init__(
        self,
        geometry: Geometry,
        key_space: str = "prenorm",
        k: int = 2,
        rank: int = 0,
        pairing: str = "ranked",
        layers: list | None = None,
        key_rank: int | None = None,
    ):
        super().__init__(geometry, key_space)
        g = geometry
        if not 1 <= k <= g.source_layers:
            raise TranslatorError(
                f"k={k} source layers per target layer, but the source has {g.source_layers}; "
                f"pass --k between 1 and {g.source_layers}"
            )
        if pairing not in PAIRINGS:
            raise TranslatorError(f"pairing {pairing!r} is not one of {PAIRINGS}")
        self.k, self.rank, self.pairing = k, rank, pairing
        self.key_rank = rank if key_rank is None else key_rank
        self.ranks = (self.key_rank, self.rank)  # keys', values'
        self.d_in, self.d_out = k * g.source_kv_heads * g.source_head_dim, g.target_kv_heads * g.target_head_dim
        for name, r in (("rank", rank), ("key rank", self.key_rank)):
            if r < 0 or r > min(self.d_in, self.d_out):
                raise TranslatorError(
                    f"{name} {r} must be 0 (full) or at most min(d_in, d_out) = {min(self.d_in, self.d_out)}"
                )
        L = g.target_layers
        if layers is None:
            layers = [[proportional_layers(t, L, g.source_layers, k) for t in range(L)]] * 2
        self.register_buffer("plan", torch.tensor(layers, dtype=torch.long).view(2, L, k).clone())
        self._plan_read: tuple | None = None  # (plan's address, version, its layers as Python ints)
        if self.key_rank == rank:
            self._add_factors("", rank, 2)
        else:
            self._add_factors("key_", self.key_rank)
            self._add_factors("value_", rank)
        self.bias = nn.Parameter(torch.zeros(2, L, self.d_out))

    def _add_factors(self, prefix: str, rank: int, *stack: int) -> None:
        L = self.geometry.target_layers
        if rank:
            setattr(self, prefix + "down", nn.Parameter(torch.zeros(*stack, L, self.d_in, rank)))
            setattr(self, prefix + "up", nn.Parameter(torch.zeros(*stack, L, rank, self.d_out)))
        else:
            setattr(self, prefix + "weight", nn.Parameter(torch.zeros(*stack, L, self.d_in, self.d_out)))

    def factors(self, part: Part, cast: bool = False) -> list[torch.Tensor]:
        """The key or value map's factors (`part`), each [target layers, ...]: [W] (full) or [D, U] (a rank);
        `cast`: in the compute dtype (`Translator.cast`)."""
        names = ("down", "up") if self.ranks[part] else ("weight",)
        get = self.cast if cast else (lambda p: p)
        if self.key_rank == self.rank:
            return [get(getattr(self, name))[part] for name in names]
        prefix = ("key_", "value_")[part]
        return [get(getattr(self, prefix + name)) for name in names]

    @property
    def needs_plan(self) -> bool:
        """Whether the closed form must rank source layers before fitting."""
        return self.pairing == "ranked"

    def set_plan(self, layers: torch.Tensor) -> None:
        """layers [2, target layers, k] source-layer indices."""
        with torch.no_grad():
            self.plan.copy_(torch.as_tensor(layers, dtype=torch.long).view_as(self.plan))

    def plan_layers(self, part: Part) -> tuple[tuple[int, ...], ...]:
        """The plan of the keys or the values (`part`) as Python ints, read from the device once per change of the
        plan (so no later call waits for the device, and a CUDA graph capture may call it)."""
        stamp = (self.plan.data_ptr(), self.plan._version)
        if self._plan_read is None or self._plan_read[:2] != stamp:
            self._plan_read = (*stamp, tuple(tuple(map(tuple, p)) for p in self.plan.tolist()))
        return self._plan_read[2][part]

    def settings(self) -> dict[str, Any]:
        return {
            "k": self.k,
            "rank": self.rank,
            "key_rank": self.key_rank,
            "pairing": self.pairing,
            "layers": self.plan.tolist(),
        }

    def flops_per_token(self, part: Part | None = None) -> float:
        L = self.geometry.target_layers
        per = [2.0 * L * (r * (self.d_in + self.d_out) if r else self.d_in * self.d_out) for r in self.ranks]
        return sum(per) if part is None else per[part]

    def value_maps(self) -> ValueMaps:
        """Every target head reads every source head of the layers in the plan: W_l's columns per target head."""
        g = self.geometry
        L, H, d = g.target_layers, g.target_kv_heads, g.target_head_dim
        f = [t.detach() for t in self.factors(Part.VALUES)]
        weight = f[-1].view(L, f[-1].shape[1], H, d).permute(0, 2, 1, 3)  # [L, H_t, d_in or rank, d_t]
        return ValueMaps(
            self.plan_layers(Part.VALUES),
            per_head=False,
            weight=weight,
            bias=self.bias[1].detach().view(L, H, d),
            down=f[0] if len(f) == 2 else None,
        )

    # ------------------------------------------------------------------ translation
    def inputs(self, part: Part, cap: Capture, layers: slice) -> torch.Tensor:
        """x [n, tokens, k·H_s·d_s] for target `layers`: each one's source layers, heads concatenated."""
        idx = self.plan[part, layers]  # [n, k]
        n, k = idx.shape
        x = self.source(part, cap, idx.reshape(-1).to(cap.values.device))  # [n·k, H_s, T, d_s] FP32
        H, T, d = x.shape[1:]
        return x.view(n, k, H, T, d).permute(0, 3, 1, 2, 4).reshape(n, T, k * H * d)

    def map(self, part: Part, cap: Capture, layers: slice) -> torch.Tensor:
        """In the compute dtype (the maps cast once per change: `Translator.cast`); FP32 under gradients."""
        x = self.inputs(part, cap, layers)
        b = self.cast(self.bias)[part, layers][:, None, :]  # [n, 1, d_out]
        f = self.factors(part, cast=True)
        if len(f) == 2:
            y = torch.baddbmm(b, torch.bmm(x, f[0][layers]), f[1][layers])
        else:
            y = torch.baddbmm(b, x, f[0][layers])  # [n, T, H_t·d_t]
        g = self.geometry
        return y.view(y.shape[0], y.shape[1], g.target_kv_heads, g.target_head_dim).transpose(1, 2)

    # ------------------------------------------------------------------ closed form
    def fit_blocks(self) -> tuple[int, int, int, int]:
        return self.geometry.target_layers, 1, self.d_in, self.d_out

    def design(self, part: Part, cap: Capture) -> torch.Tensor:
        return self.inputs(part, cap, slice(None))[:, None]  # [L_t, 1, T, d_in]

    @staticmethod
    def block_targets(y: torch.Tensor) -> torch.Tensor:
        L, H, T, d = y.shape
        return y.transpose(1, 2).reshape(L, 1, T, H * d)  # [L_t, 1, T, H_t·d_t]

    @staticmethod
    def block_weights(w: torch.Tensor | None) -> torch.Tensor | None:
        return None if w is None else w.mean(1, keepdim=True)  # [L_t, 1, T]: the heads' mean

    def solve_from(self, ne: NormalEquations, ridge) -> None:
        sol = ne.solve_augmented(ridge)[:, :, 0]  # [2, L_t, d_in+1, d_out]
        with torch.no_grad():
            for part, rank in zip(PARTS, self.ranks):
                f = self.factors(part)  # views of the parameters
                if rank:
                    left, right = reduced_rank(sol[part], ne.A.cpu()[part, :, 0], rank)
                    f[0].copy_(left[..., :-1, :].float())
                    f[1].copy_(right.float())
                    self.bias[part].copy_((left[..., -1:, :] @ right)[..., 0, :].float())
                else:
                    f[0].copy_(sol[part, :, :-1, :].float())
                    self.bias[part].copy_(sol[part, :, -1, :].float())


class CrossHead(CrossLayer):
    family = "crosshead"

    def __init__(
        self,
        geometry: Geometry,
        key_space: str = "prenorm",
        rank: int = 0,
        layers: list | None = None,
        key_rank: int | None = None,
    ):
        super().__init__(geometry, key_space, k=1, rank=rank, pairing="proportional", layers=layers, key_rank=key_rank)

    def settings(self) -> dict[str, Any]:
        return {"rank": self.rank, "key_rank": self.key_rank, "layers": self.plan.tolist()}

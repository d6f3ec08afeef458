"""The residual family: a small per-layer MLP on top of a linear family.

    y = base(x) + MLP_l(base(x)),   MLP_l(z) = W2_l · gelu(W1_l z + c1_l) + c2_l

applied to each target KV head's translated features z [head_dim] (weights shared by the
heads of a layer, separate for K and V). W2 and c2 start at zero, so at initialisation the
family is exactly its base; the base is fitted in closed form as usual and the MLP is trained
by distillation only. W1 starts from a seeded normal draw (fixed by `init_seed`, so a run does
not depend on the global RNG's state when the translator is built).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ...cache import Capture
from ...translator import Geometry, LinearFamily, Part, TranslatorError
from .. import FAMILIES


class Residual(LinearFamily):
    family = "residual"

    def __init__(
        self,
        geometry: Geometry,
        key_space: str = "prenorm",
        base: dict | None = None,
        hidden: int = 64,
        init_seed: int = 0,
    ):
        super().__init__(geometry, key_space)
        base = base or {"family": "headwise", "settings": {}}
        if base.get("family") not in FAMILIES or base["family"] == self.family:
            raise TranslatorError(
                f"the residual family needs a linear base family, not {base.get('family')!r}; "
                "pass --base headwise, crosshead or crosslayer"
            )
        self.base = FAMILIES[base["family"]].from_spec(geometry, key_space, base.get("settings", {}))
        if not isinstance(self.base, LinearFamily):
            raise TranslatorError(f"the residual family's base must have a closed form; {base['family']} has none")
        self.hidden, self.init_seed = hidden, init_seed
        L, d = geometry.target_layers, geometry.target_head_dim
        gen = torch.Generator().manual_seed(init_seed)
        self.w1 = nn.Parameter(torch.randn(2, L, d, hidden, generator=gen) / math.sqrt(d))
        self.c1 = nn.Parameter(torch.zeros(2, L, hidden))
        self.w2 = nn.Parameter(torch.zeros(2, L, hidden, d))
        self.c2 = nn.Parameter(torch.zeros(2, L, d))

    def settings(self) -> dict[str, Any]:
        return {
            "base": {"family": self.base.family, "settings": self.base.settings()},
            "hidden": self.hidden,
            "init_seed": self.init_seed,
        }

    def flops_per_token(self, part: Part | None = None) -> float:
        g = self.geometry
        mlp = 2.0 * g.target_layers * g.target_kv_heads * 2 * g.target_head_dim * self.hidden  # keys or values
        return self.base.flops_per_token(part) + mlp * (2 if part is None else 1)

    def bind(self, source, target) -> Residual:
        super().bind(source, target)
        self.base.space = self.space
        return self

    def map(self, part: Part, cap: Capture, layers: slice) -> torch.Tensor:
        z = self.base.map(part, cap, layers)  # [n, H, T, d]
        h = F.gelu(torch.einsum("nhtd,ndk->nhtk", z, self.w1[part, layers]) + self.c1[part, layers][:, None, None])
        return z + torch.einsum("nhtk,nkd->nhtd", h, self.w2[part, layers]) + self.c2[part, layers][:, None, None]

    # ------------------------------------------------------------------ closed form: the base's
    @property
    def needs_plan(self) -> bool:
        return self.base.needs_plan

    def set_plan(self, layers) -> None:
        self.base.set_plan(layers)

    def fit_blocks(self):
        return self.base.fit_blocks()

    def design(self, part: Part, cap: Capture) -> torch.Tensor:
        return self.base.design(part, cap)

    def block_targets(self, y: torch.Tensor) -> torch.Tensor:
        return self.base.block_targets(y)

    def block_weights(self, w):
        return self.base.block_weights(w)

    def solve_from(self, ne, ridge) -> None:
        self.base.solve_from(ne, ridge)

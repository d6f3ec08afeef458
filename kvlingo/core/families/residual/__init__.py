"""The residual family: a small per-layer MLP on top of a linear family's translated features (trained by
distillation only; the base is fitted in closed form). Its maps: `maps.Residual`."""

from ...settings import Family, Option

RESIDUAL = Family(
    "residual",
    "a linear family plus a small per-layer MLP on its translated features",
    "kvlingo.core.families.residual.maps:Residual",
    options=(
        Option("base", "the linear family under the MLP", "headwise", str, base=True),
        Option("hidden", "the MLP's hidden width", 64, minimum=1),
    ),
    linear=False,
)

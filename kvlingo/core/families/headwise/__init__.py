"""The head-wise family: one affine map per (K/V, layer, KV head); head h of layer l reads head h of layer l only,
so the pair must have the same layer and KV-head counts (head_dim may differ). Its maps: `maps.Headwise`."""

from ...settings import Family, Variant

HEADWISE = Family(
    "headwise",
    "one affine map per (K/V, layer, KV head): head h of layer l reads head h of layer l",
    "kvlingo.core.families.headwise.maps:Headwise",
    variants=(
        Variant("headwise", note="head-wise maps: one affine map per (layer, KV head)", default_run=False),
        Variant(
            "headwise-ridge0",
            note="the seed design: head-wise maps, plain least squares",
            train_flags=("--ridge", "0"),
            default_run=False,
        ),
        Variant(
            "headwise-exact0", note="head-wise maps, the target's own layer 0", refresh="exact:0", default_run=False
        ),
    ),
)

"""The token-input family: a linear family's maps plus the target's own layer-0 features of each token and of the
window − 1 tokens before it, computed from the token ids (kvlingo.core.layer0). Its maps: `maps.TokenInput`."""

from ...settings import Family, Option, Variant, half_target_width

BASES = ("headwise", "crosshead", "crosslayer")

TOKENINPUT = Family(
    "tokeninput",
    "a linear family plus the target's layer-0 features of each token and the window − 1 before it",
    "kvlingo.core.families.tokeninput.maps:TokenInput",
    options=(
        Option("base", "the linear family beside the token features", "headwise", str, choices=BASES, base=True),
        Option(
            "rank",
            "rank of the token-feature maps, one down-projection shared by the layers (0: full)",
            half_target_width,
            flag="--token-rank",
            minimum=0,
            width_scaled=True,
        ),
        Option("window", "each token's features and those of the window − 1 tokens before it", 3, minimum=1),
    ),
    variants=(
        Variant(
            "token-w3",
            note="head-wise maps plus the target's layer-0 features of the token and the two before it (rank half "
            "the target width), own layer 0",
            refresh="exact:0",
        ),
        Variant(
            "token-w1",
            {"window": 1},
            "token identity of each token alone, own layer 0",
            refresh="exact:0",
            default_run=False,
        ),
        Variant("token-w3-full", {"token_rank": 0}, "token-w3 at full rank", refresh="exact:0", default_run=False),
    ),
    reads_layer0=True,
)

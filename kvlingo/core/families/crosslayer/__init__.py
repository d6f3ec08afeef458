"""The cross-head and cross-layer families: every target KV head reads every source KV head of some source layers,
through a full map or a rank; neither the depths, the KV-head counts nor head_dim need to match. Their maps:
`maps.CrossLayer`, `maps.CrossHead`."""

from ...settings import Family, Option, Variant, half_target_width, quarter_target_width

PAIRINGS = ("ranked", "proportional")
RANK = Option(
    "rank",
    "rank of each layer's maps (0: full; the keys' too unless --key-rank)",
    0,
    minimum=0,
    width_scaled=True,
)
KEY_RANK = Option(
    "key_rank", "rank of the key maps alone (0: full; default: --rank's)", None, minimum=0, width_scaled=True
)

CROSSLAYER = Family(
    "crosslayer",
    "every target KV head reads every source KV head of the k source layers ranked best for its layer",
    "kvlingo.core.families.crosslayer.maps:CrossLayer",
    options=(
        Option("k", "source layers per target layer", 2, minimum=1, source_layers=True),
        RANK,
        KEY_RANK,
        Option(
            "pairing",
            "source layers ranked by held-out R², or nearest by relative depth",
            "ranked",
            str,
            choices=PAIRINGS,
        ),
    ),
    variants=(
        Variant(
            "crosslayer-k4-rhalf",
            {"k": 4, "rank": half_target_width},
            "the top-4 source layers through a rank of half the target width (the s2l default before tokeninput)",
        ),
    ),
)

CROSSHEAD = Family(
    "crosshead",
    "every target KV head reads every source KV head of the source layer at the same relative depth",
    "kvlingo.core.families.crosslayer.maps:CrossHead",
    options=(RANK, KEY_RANK),
    variants=(
        Variant(
            "crosshead",
            note="all source heads → all target heads, same relative depth (the l2s default before tokeninput)",
        ),
        Variant(
            "crosshead-exact0",
            note="cross-head maps, the target's own layer 0 from the token ids",
            refresh="exact:0",
        ),
        Variant(
            "crosshead-key-rquarter",
            {"key_rank": quarter_target_width},
            "cross-head maps, the keys' through a rank of a quarter of the target width (values full)",
            default_run=False,
        ),
    ),
)

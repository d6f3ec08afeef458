"""The token-input family: a linear family's maps plus the target's own layer-0 features of each token and of the
window − 1 tokens before it, computed from the token ids (kvlingo.core.layer0). Its maps: `maps.TokenInput`.

Its variants are the token path's costs and what each buys: the window, the rank, the part of the cache
(keys, values or both) and the layers that read the token features (the first ones, or those the closed form
chooses on held-out conversations), priced at the real shapes by the
ablation (kvlingo/stages/ablation.py)."""

from ...settings import (
    Family,
    Option,
    Variant,
    eighth_target_width,
    half_target_layers,
    half_target_width,
    quarter_target_width,
)

BASES = ("headwise", "crosshead", "crosslayer")
OWN_LAYER0 = "exact:0"  # every variant hands over with the target's own layer 0 from the token ids

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
        Option(
            "token_parts",
            "which part of the cache reads the token features: keys, values or both",
            "both",
            str,
            choices=("both", "keys", "values"),
        ),
        Option(
            "token_layers",
            "N target layers read the token features: the first N, or the last N or those the closed form picks "
            "(--token-choice; 0: all of them)",
            0,
            minimum=0,
            depth_scaled=True,
        ),
        Option(
            "token_choice",
            "which N layers read the token features: first, last, or fit (the N whose held-out closed-form error "
            "the features lower most)",
            "first",
            str,
            choices=("first", "last", "fit"),
        ),
    ),
    variants=(
        Variant(
            "token-w3",
            note="head-wise maps plus the target's layer-0 features of the token and the two before it (rank half "
            "the target width), own layer 0",
            refresh=OWN_LAYER0,
        ),
        Variant("token-w2", {"window": 2}, "the token and the one before it, own layer 0", refresh=OWN_LAYER0),
        Variant("token-w1", {"window": 1}, "token identity of each token alone, own layer 0", refresh=OWN_LAYER0),
        Variant(
            "token-w5",
            {"window": 5},
            "the token and the four before it, own layer 0 (a wider window for deep pairs)",
            refresh=OWN_LAYER0,
            default_run=False,
        ),
        Variant(
            "token-w8",
            {"window": 8},
            "the token and the seven before it, own layer 0 (a wider window for deep pairs)",
            refresh=OWN_LAYER0,
            default_run=False,
        ),
        Variant(
            "token-w3-rquarter",
            {"token_rank": quarter_target_width},
            "token-w3 through a rank of a quarter of the target width",
            refresh=OWN_LAYER0,
        ),
        Variant(
            "token-w3-reighth",
            {"token_rank": eighth_target_width},
            "token-w3 through a rank of an eighth of the target width",
            refresh=OWN_LAYER0,
        ),
        Variant(
            "token-w3-values",
            {"token_parts": "values"},
            "token-w3 on the values only (the keys head-wise alone)",
            refresh=OWN_LAYER0,
        ),
        Variant(
            "token-w3-keys",
            {"token_parts": "keys"},
            "token-w3 on the keys only (the values head-wise alone)",
            refresh=OWN_LAYER0,
        ),
        Variant(
            "token-w3-lower",
            {"token_layers": half_target_layers},
            "token-w3 in the first half of the target's layers only",
            refresh=OWN_LAYER0,
        ),
        Variant(
            "token-w3-chosen",
            {"token_layers": half_target_layers, "token_choice": "fit"},
            "token-w3 in half of the target's layers, those whose held-out closed-form error the token features lower "
            "most",
            refresh=OWN_LAYER0,
            default_run=False,
        ),
        Variant(
            "token-w3-upper",
            {"token_layers": half_target_layers, "token_choice": "last"},
            "token-w3 in the second half of the target's layers only (where the deep pair's per-layer diagnostic "
            "puts the error)",
            refresh=OWN_LAYER0,
            default_run=False,
        ),
        Variant(
            "token-w3-crosslayer",
            {"base": "crosslayer", "k": 2, "rank": eighth_target_width},
            "token-w3 on a cross-layer base (every source KV head of the two source layers ranked best for each "
            "target layer, through a rank of an eighth of the target width): cross-layer inputs with token identity",
            refresh=OWN_LAYER0,
            default_run=False,
        ),
        Variant("token-w3-full", {"token_rank": 0}, "token-w3 at full rank", refresh=OWN_LAYER0, default_run=False),
        Variant(
            "token-w3-outfit",
            note="token-w3 with its value maps fitted in closed form to the target's attention output (what its "
            "reply-time queries read from the context), not to the raw values",
            refresh=OWN_LAYER0,
            train_flags=("--value-fit", "output"),
            default_run=False,
        ),
        Variant(
            "token-w3-cosine",
            note="token-w3 distilled with its learning rate decayed to 0 on a half cosine over the updates, named "
            "(the profiles' default schedule; the row of the runs that chose it)",
            refresh=OWN_LAYER0,
            train_flags=("--lr-schedule", "cosine"),
            default_run=False,
        ),
        Variant(
            "token-w3-constant",
            note="token-w3 distilled at a constant learning rate (the default schedule until the cosine decay)",
            refresh=OWN_LAYER0,
            train_flags=("--lr-schedule", "constant"),
            default_run=False,
        ),
    ),
    reads_layer0=True,
)

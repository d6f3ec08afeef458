"""Random translators of every family that defers its values, bound to the tiny pair or to a source of another
geometry (the `translator_pairs` fixture): what the deferred-values tests run."""

from __future__ import annotations

from dataclasses import asdict

import torch
from refs import random_maps

from kvlingo.core.cache import capture
from kvlingo.core.handoff import translate_to_cache
from kvlingo.core.translator import Geometry
from kvlingo.records.saved import build

# BF16: the deferred path rounds in other places than a translated BF16 cache (it never rounds the
# translated values; it rounds each source value's mix before mapping it in FP32). Against FP32 maths on
# the same weights its logits are as far off as the translated cache's: over 4 seeds of each translator
# below, both errors 0.012-0.049 (max |logit| 1.9-3.1), the deferred one 0.81-1.41× the translated
# cache's (head-wise up to 1.41×, cross-head 1.29×, cross-layer 1.38×). Allowed: 1.5× that error plus
# one BF16 rounding of the largest logit.
DEFERRED_BF16_FACTOR = 1.5


# The translators: (name, pair, family, settings). "tiny" is the tiny pair (2 layers × 2 KV heads × 16
# both sides); "other" a 3-layer source with 1 KV head × 32 into the tiny 2-layer target (2 × 16).
TRANSLATORS = [
    ("headwise", "tiny", "headwise", {}),
    ("crosshead", "tiny", "crosshead", {}),
    ("crosshead key rank 8", "tiny", "crosshead", {"key_rank": 8}),
    ("crosshead other", "other", "crosshead", {}),
    ("crosslayer k=2", "other", "crosslayer", {"k": 2, "pairing": "proportional"}),
    ("crosslayer k=2 rank 12", "other", "crosslayer", {"k": 2, "rank": 12, "pairing": "proportional"}),
    (
        "crosslayer k=2 rank 12, key rank 6",
        "other",
        "crosslayer",
        {"k": 2, "rank": 12, "key_rank": 6, "pairing": "proportional"},
    ),
]


NAMES = [t[0] for t in TRANSLATORS]


def random_family(family: str, source, target, seed: int = 0, **settings):
    """Random maps of a family, bound to the pair: weights N(0, 1/fan-in) (N(0, 0.3) head-wise), biases N(0, 0.1)."""
    if family == "headwise":
        return random_maps(source, target, seed)
    maps = build(
        {
            "family": family,
            "key_space": "prenorm",
            "settings": settings,
            "geometry": asdict(Geometry.of(source, target)),
        }
    )
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in maps.parameters():
            p.normal_(0.0, p.shape[-2] ** -0.5 if p.dim() >= 3 else 0.1, generator=g)
    return maps.bind(source, target).requires_grad_(False)


def translator(translator_pairs, name: str, dtype=torch.float32, seed: int = 0):
    _, which, family, settings = TRANSLATORS[NAMES.index(name)]
    source, target = translator_pairs[which, dtype]
    return source, target, random_family(family, source, target, seed, **settings)


def translated_and_deferred(source, target, maps, ids, n: int, room: int):
    with torch.no_grad():
        cap = capture(source, ids[:, :n])
        plain = translate_to_cache(source, target, maps, cap=cap, room=room)
        deferred = translate_to_cache(source, target, maps, cap=cap, room=room, defer_values=True)
    return cap, plain, deferred

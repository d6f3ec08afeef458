"""The benchmark's inputs on the tiny pair: synthetic chats, a prepared test split, and closed-form maps fitted on
them (the `bench_setup` fixture, the GPU check's dry run)."""

from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path

import torch

from kvlingo.core.cache import capture
from kvlingo.core.families.headwise.maps import Headwise
from kvlingo.core.fit import NormalEquations
from kvlingo.core.handoff import as_ids
from kvlingo.core.translator import Geometry
from kvlingo.inputs.models import render_ids

WORDS = (
    "the cat sat on a mat while ada wrote code in the lab remember what was said before yes no Paris Rome blue red"
).split()


def conversations(tok, n: int, seed: int) -> list[dict]:
    """Rows in the prepared-split format, with prefixes of varied length (so the control pairing must crop and join)."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        msgs = [{"role": "user", "content": " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 24)))}]
        prefix = render_ids(tok, msgs, enable_thinking=False)
        reply_text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 7))) + "<|im_end|>"
        reply = tok(reply_text, add_special_tokens=False)["input_ids"]
        cid = hashlib.sha256(json.dumps([seed, i, prefix, reply]).encode()).hexdigest()
        rows.append(
            {
                "id": cid,
                "prefix_ids": prefix,
                "reply_ids": reply,
                "prefix_text": tok.decode(prefix),
                "reply_text": reply_text,
                "reasoning": False,
                "source_ids": [str(i)],
            }
        )
    return rows


def write_split(folder: Path, tok, test_rows: list[dict]) -> Path:
    from tinypair import write_prepared

    return write_prepared(folder, tok, {"test": test_rows})


def fit_maps(source, target, convs: list[dict], key_space: str, ridges: tuple[float, ...]) -> list[Headwise]:
    """Closed-form head-wise maps fitted on whole conversations (source features → target features), one per ridge."""
    geometry = Geometry.of(source, target)
    tr = Headwise(geometry, key_space).bind(source, target)
    ne = NormalEquations(*tr.fit_blocks())
    with torch.no_grad():
        for c in convs:
            ids = as_ids(c["prefix_ids"] + c["reply_ids"], "cpu")
            s, t = capture(source, ids), capture(target, ids)
            ne.update(0, tr.design(0, s), tr.space.target_keys(t))
            ne.update(1, tr.design(1, s), t.values)
    out = []
    for ridge in ridges:
        maps = Headwise(geometry, key_space)
        maps.set_solution(*ne.solve(ridge))
        out.append(maps.bind(source, target))
    return out


def pair_args(s) -> list[str]:
    return ["--large", str(s["large_p"]), "--small", str(s["small_p"]), "--device", "cpu"]

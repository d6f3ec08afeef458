"""A training's inputs on the tiny pair: chat rows, a prepared train/validation split (the `train_data`
fixture) and a closed-form fit."""

from __future__ import annotations

from pathlib import Path

from tinypair import chat_rows, write_prepared

from kvlingo.core.families.headwise.maps import Headwise
from kvlingo.core.translator import Geometry
from kvlingo.train.closed_form import fit_closed_form


def make_rows(tok, n: int, seed: int, tag: str) -> list[dict]:
    return chat_rows(tok, n, seed, tag, system_every=3)


def write_train_split(folder: Path, train: list[dict], val: list[dict]) -> Path:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(TOK[0])
    return write_prepared(folder, tok, {"train": train, "validation": val})


TOK: list = []  # the tiny pair's tokenizer folder, set by the data fixture


def fitted(pair, rows, key_space="prenorm", weighting="uniform", ridge=0.0, value_fit="values"):
    """A head-wise translator fitted in closed form on `rows`, bound to the pair, and its fit statistics."""
    tr = Headwise(Geometry.of(pair.source, pair.target), key_space).bind(pair.source, pair.target)
    stats = fit_closed_form(pair.source, pair.target, tr, rows, weighting, ridge, value_fit=value_fit)
    return tr, stats

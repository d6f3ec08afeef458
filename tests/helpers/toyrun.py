"""A run made with the real stages on closed-form maps fitted here (benchmark, export): the `toy_run` fixture
and kvlingo.Relay's tests."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

import benchmark
from kvlingo.core.translator import Geometry
from kvlingo.inputs.models import load_pair, resolve_pair
from kvlingo.records.saved import build, save_translator
from kvlingo.train.closed_form import fit_closed_form

FAMILY = "headwise"  # the family fitted here; nothing below depends on which one it is
REFRESH = "tail:2"  # the toy run's handoff: the target recomputes the last 2 context tokens


def fitted_run(root: Path, run: str, large: Path, small: Path, train: list[dict], key_space: str) -> list[str]:
    """Closed-form maps of the pair fitted on `train`, saved as the run's distilled translator; returns the pair
    flags."""
    cfg, tok = resolve_pair(str(large), str(small), "l2s", "cpu", "float32")
    pair = load_pair(cfg, tok)
    translator = build(
        {
            "family": FAMILY,
            "key_space": key_space,
            "settings": {},
            "geometry": asdict(Geometry.of(pair.source, pair.target)),
        }
    ).bind(pair.source, pair.target)
    fit_closed_form(pair.source, pair.target, translator, train)
    save_translator(
        root / "artifacts" / run / "distilled",
        translator,
        {"direction": "l2s", "models": pair.identities(), "stage": "distilled"},
    )
    return ["--large", str(large), "--small", str(small), "--direction", "l2s", "--device", "cpu", "--dtype", "float32"]


def run_flags(root: Path, run: str) -> list[str]:
    return ["--run", run, "--artifacts", str(root / "artifacts"), "--results", str(root / "results")]


def bench(root: Path, run: str, pair: list[str], data: Path, refresh: str = "none") -> None:
    benchmark.main(
        [
            "--profile",
            "tiny",
            *run_flags(root, run),
            *pair,
            "--data",
            str(data),
            "--skip-missing",
            "--timing-conversations",
            "0",
            "--control-dtypes",
            "float32",
            "--refresh",
            refresh,
        ]
    )

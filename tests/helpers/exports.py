"""Exported translators for the serving tests, built in seconds in the suite's environment (.venv).

A translator is fitted in closed form on a few conversations, benchmarked on the tiny profile's
test split and exported with its figures, as `make train benchmark export` would (the real stages;
no distillation). tests/serve/build_fixtures.py runs these for the tests in the serving environment, whose
transformers cannot run the suite's stages; tests/serve/test_contract.py calls them directly.
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path


def export_run(
    root: Path,
    run: str,
    large: Path,
    small: Path,
    train: list[dict],
    data: Path,
    key_space: str,
    family: str = "crosshead",
    direction: str = "l2s",
    refresh: str = "none",
    flags: dict | None = None,
) -> Path:
    """Closed-form maps of the pair (the family's option values `flags` by dest, e.g. a variant's; the rest its
    defaults) fitted on `train`, benchmarked on `data`'s test split and exported; returns the export folder (its
    gate verdict is whatever the figures say)."""
    import benchmark
    import export
    from kvlingo.core.translator import Geometry
    from kvlingo.inputs.models import load_pair, resolve_pair
    from kvlingo.records.saved import build, save_translator
    from kvlingo.train.closed_form import fit_closed_form
    from kvlingo.train.config import family_settings

    cfg, tok = resolve_pair(str(large), str(small), direction, "cpu", "float32")
    pair = load_pair(cfg, tok)
    geometry = Geometry.of(pair.source, pair.target)
    translator = build(
        {
            "family": family,
            "key_space": key_space,
            "settings": family_settings(family, flags, geometry),
            "geometry": asdict(geometry),
        }
    ).bind(pair.source, pair.target)
    fit_closed_form(pair.source, pair.target, translator, train)
    save_translator(
        root / "artifacts" / run / "distilled",
        translator,
        {"direction": direction, "models": pair.identities(), "stage": "distilled"},
    )
    flags = ["--run", run, "--artifacts", str(root / "artifacts"), "--results", str(root / "results")]
    pair_flags = [
        "--large",
        str(large),
        "--small",
        str(small),
        "--direction",
        direction,
        "--device",
        "cpu",
        "--dtype",
        "float32",
    ]
    benchmark.main(
        [
            "--profile",
            "tiny",
            *flags,
            *pair_flags,
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
    export.main(flags)
    return root / "artifacts" / run / "export"

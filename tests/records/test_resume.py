"""Resume keys (kvlingo/records/resume.py): a report or a ledger edited out of shape is made again or refused."""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: one torch thread per module


def test_reports_and_ledgers_edited_out_of_shape_are_made_again_or_refused(tmp_path):
    """Valid JSON of the wrong shape once raised AttributeError or KeyError: an up-to-date check now takes such a
    report as unfinished (the stage makes it again), and a recipe ledger is refused with the entry named."""
    from kvlingo.records.resume import ResumeRefused, finished
    from kvlingo.stages.ledger import LEDGER_FORMAT, Ledger

    report = tmp_path / "benchmark.json"
    good = {"resume_key": "k", "results": {"checks": {"passed": True}}}
    for text, up_to_date in (
        (good, True),
        ([1, 2], False),
        ({"resume_key": "k"}, False),
        ({**good, "results": None}, False),
        ({**good, "results": {"checks": {"passed": False}}}, False),
        ({**good, "resume_key": "other"}, False),
    ):
        report.write_text(json.dumps(text))
        assert (finished(report, "k") is not None) == up_to_date, text

    ledger = tmp_path / "recipe-state.json"
    for state, why in (
        ([], "ledger format list"),
        ({"format": LEDGER_FORMAT, "config": {}, "cells": []}, "cells is not"),
        (
            {"format": LEDGER_FORMAT, "config": {}, "cells": {"train/a": {"status": "done"}}},
            "cells.train/a is not a ledger entry",
        ),
    ):
        ledger.write_text(json.dumps(state))
        with pytest.raises(ResumeRefused, match=why):
            Ledger(ledger, {}, resume=True)
        assert json.loads(ledger.read_text()) == state  # refused before anything is written


def test_the_code_hash_follows_the_families_lazy_maps(tmp_path):
    """A family names its maps' module in a string ("kvlingo.….maps:Class", imported on first use), where the tensor
    maths of every translator lives: the code hash of every stage that trains or loads one must cover those files,
    so that an edit to them makes a resume refuse rather than reuse translators made by other code."""
    from kvlingo.core.families import FAMILIES
    from kvlingo.records.resume import _imports, _module_file, imported_files

    maps = {_module_file(f.maps.partition(":")[0]) for f in FAMILIES.values()}
    assert None not in maps and len(maps) == 4, maps  # headwise, crosslayer (and crosshead), residual, tokeninput
    for script in ("train_translator.py", "benchmark.py", "task_eval.py", "ifeval.py", "frontier.py", "layers.py"):
        missing = maps - set(imported_files(script))
        assert not missing, f"{script}'s code hash misses {sorted(str(m) for m in missing)}"

    lazy = tmp_path / "lazy.py"
    lazy.write_text(
        'MAPS = "kvlingo.core.fit:NormalEquations"\nNAME = "kvlingo.core.rope"\n'
        'PROSE = "see kvlingo.core.kl for the KL"\nPARTIAL = "kvlingo."\n'
    )
    assert _imports(lazy) == {"kvlingo.core.fit", "kvlingo.core.rope"}

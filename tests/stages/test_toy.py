"""The toy world stage: the mini build takes its budget, an unwritable out folder is named first, and --help names
the packaged builds without importing torch."""

from __future__ import annotations

import json

import pytest

from kvlingo.toy import train as toytrain

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: one torch thread per module


def test_toy_world_mini_build_takes_its_budget(tmp_path):
    """--minutes-per-model 0: each model trains the budget's floor of steps, and the manifest records the budget."""
    import toy_world

    toy_world.main(["--out", str(tmp_path / "toy"), "--mini", "--minutes-per-model", "0"])
    manifest = json.loads((tmp_path / "toy" / "manifest.json").read_text())
    cfg, models = manifest["config"], manifest["results"]["models"]
    assert cfg["large_minutes"] == cfg["small_minutes"] == 0.0 and manifest["results"]["mini"]
    assert models["large"]["train_steps"] == models["small"]["train_steps"] == cfg["min_steps"]


def test_toy_world_names_an_out_folder_it_cannot_write_before_building_anything(tmp_path, monkeypatch, capsys):
    import sys

    import toy_world

    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    monkeypatch.setattr(
        "kvlingo.toy.train.install_pair", lambda *a, **k: pytest.fail("installed into an unwritable folder")
    )
    monkeypatch.setattr(sys, "argv", ["toy_world.py", "--out", str(blocker / "toy")])
    with pytest.raises(SystemExit) as e:
        toy_world.main()
    message = capsys.readouterr().err
    assert e.value.code == 2 and message.startswith(f"toy_world: cannot write to {blocker / 'toy'}"), message
    assert "give --out a folder you can write to" in message and blocker.read_text() == "x"


def test_the_toy_stage_names_the_packaged_builds_the_toy_modules_install():
    """toy_world.py's --help names the packaged builds without importing the torch modules that own them."""
    from kvlingo.stages import toy
    from kvlingo.toy import deep, mismatched

    assert toy.PACKAGED == toytrain.PACKAGED.resolve()
    assert toy.PACKAGED_MISMATCHED == mismatched.PACKAGED_MISMATCHED.resolve()
    assert toy.PACKAGED_DEEP == deep.PACKAGED_DEEP.resolve()

"""The data stage end to end: it builds then reports up to date, streams the Hub revision and row cap it is
given, and leaves no staging folder on a full disk."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from stagecli import full_disk, refused

import prepare
from kvlingo.io import read_json
from kvlingo.toy.tokenizer import save_tokenizer

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: one torch thread per module


ROOT = Path(__file__).resolve().parents[2]


def test_data_stage_streams_the_revision_and_row_cap_it_is_given(tmp_path, monkeypatch, capsys):
    """--revision names the Hub commit streamed, --max-rows bounds the rows read (the Hub stands in by the toy
    corpus)."""
    import kvlingo.inputs.data as data
    import prepare

    toy = tmp_path / "toy"
    sys.path.insert(0, str(ROOT))
    from kvlingo.toy import train as toytrain

    toytrain.install_pair(toy, log=lambda _msg: None)
    asked = []

    def revision(hub):
        asked.append(hub.revision)
        return "e" * 40

    monkeypatch.setattr(data, "resolve_hub_revision", revision)
    monkeypatch.setattr(data, "hub_rows", lambda hub, commit: data.local_rows(toy / "corpus" / "chats.jsonl"))
    prepare.main(
        [
            "--profile",
            "tiny",
            "--tokenizer",
            str(toy / "small"),
            "--out",
            str(tmp_path / "data"),
            "--revision",
            "a" * 40,
            "--max-rows",
            "30",
        ]
    )
    manifest = json.loads((tmp_path / "data" / "tiny" / "manifest.json").read_text())
    source = manifest["inputs"]["source"]
    assert asked == ["a" * 40] and source["revision_requested"] == "a" * 40 and source["max_rows"] == 30
    assert manifest["results"]["rows"]["read"] == 30


def test_a_full_disk_while_preparing_data_leaves_no_staging_folder(benchmarked_run, tmp_path, monkeypatch, capsys):
    """Once, a traceback and the `.PROFILE.building-PID` staging folder left behind."""
    source = tmp_path / "chats.jsonl"
    source.write_text(
        "".join(
            json.dumps(
                {
                    "input": [{"role": "user", "content": f"hello {i} " * 5}],
                    "output": f"answer {i} " * 3,
                    "reasoning": "off",
                }
            )
            + "\n"
            for i in range(60)
        )
    )
    out = tmp_path / "data"
    full_disk(monkeypatch, out)
    err = refused(
        prepare.main,
        [
            "--profile",
            "tiny",
            "--source",
            str(source),
            "--tokenizer",
            str(benchmarked_run["pair"][1]),
            "--out",
            str(out),
        ],
        capsys,
    )
    assert err.startswith(f"prepare: no space left in {out}/.tiny.building-"), err
    assert [p.name for p in out.iterdir()] == [".prepare-tiny.lock"]


def test_cli_builds_then_reports_up_to_date(prepare_world, tmp_path, capsys):
    import prepare

    tok_dir = save_tokenizer(prepare_world["tok"], tmp_path / "tok")
    argv = [
        "--profile",
        "tiny",
        "--source",
        str(prepare_world["source"]),
        "--tokenizer",
        str(tok_dir),
        "--out",
        str(tmp_path / "out"),
    ]
    prepare.main(argv)
    assert "built" in capsys.readouterr().out
    prepare.main(argv)
    out = capsys.readouterr().out
    assert "up to date" in out and "train.packed" in out
    # same bytes as the library call with the same tokenizer and seed
    assert read_json(tmp_path / "out" / "tiny" / "manifest.json")["files"] == prepare_world["result"].manifest["files"]
    with pytest.raises(SystemExit) as e:
        prepare.main(["--profile", "tiny", "--tokenizer", str(tok_dir), "--out", str(tmp_path / "hub")])
    assert e.value.code == 2 and "--source PATH" in capsys.readouterr().err


def test_every_offline_help_example_fills_its_profile(toy_pair, tmp_path, capsys):
    """Once, the first --help example fed the demo profile chats.jsonl, whose usable conversations left
    validation.natural short (226 of 256, with a warning). Each example with a toy --source runs as typed after
    `make toy` (a chats.N.jsonl source made as the --help text says: toy_world.py --chats N) and fills every split."""
    import re
    import shlex

    from kvlingo.stages.prepare import Prepare
    from kvlingo.stages.toy import more_chats

    offline = [
        shlex.split(line)[2:]
        for line in Prepare.examples
        if line.startswith(".venv/bin/python prepare.py") and "--source artifacts/toy/" in line
    ]
    assert len(offline) >= 2  # the demo's and the tiny profile's
    for i, argv in enumerate(offline):
        source = argv[argv.index("--source") + 1]
        more = re.fullmatch(r"artifacts/toy/corpus/chats\.(\d+)\.jsonl", source)
        toy = toy_pair
        if more:  # a corpus file toy_world.py --chats N writes: made here from the toy pair's world, as said
            assert f"toy_world.py --out artifacts/toy --chats {more[1]}" in " ".join(Prepare.examples), source
            toy = tmp_path / f"toy{i}"
            (toy / "corpus").mkdir(parents=True)
            more_chats(toy, read_json(toy_pair / "manifest.json"), int(more[1]))
        argv = [str(toy_pair / v.removeprefix("artifacts/toy/")) if v.startswith("artifacts/toy/") else v for v in argv]
        argv[argv.index("--source") + 1] = str(toy / source.removeprefix("artifacts/toy/"))
        prepare.main([a for a in argv if a != "--force"] + ["--out", str(tmp_path / f"data{i}")])
        out = capsys.readouterr().out
        assert "built" in out and "WARNING" not in out, (argv, out)

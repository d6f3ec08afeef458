"""Every stage's flags are spelled out in full: an abbreviation (`--update 10`, which argparse would take as
`--updates 10` and run) or a misspelling is refused with one line naming the nearest real flag, exit 2, before
anything is read or written."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from test_argtypes import STAGES, _parser_of

ROOT = Path(__file__).resolve().parents[1]
REQUIRED = {"task_eval": ["--task", "arc"], "toy_world": ["--out", "unused"]}  # taken before the flag under test


def abbreviation(parser) -> tuple[str, str]:
    """(an abbreviation of the parser's longest long flag that no other flag starts with, that flag)."""
    flags = sorted(
        {o for a in parser._actions for o in a.option_strings if o.startswith("--") and o != "--help"},
        key=lambda o: (-len(o), o),
    )
    for full in flags:
        short = full[:-2]
        if [o for o in flags if o.startswith(short)] == [full]:
            return short, full
    raise AssertionError("no flag with an unambiguous abbreviation")


@pytest.mark.parametrize("name", STAGES)
def test_every_stage_refuses_an_abbreviated_flag_and_names_the_full_one(name, monkeypatch, capsys):
    parser = _parser_of(name, monkeypatch)
    monkeypatch.undo()
    short, full = abbreviation(parser)
    with pytest.raises(SystemExit) as e:
        parser.parse_args([*REQUIRED.get(name, []), short, "1"])
    err = capsys.readouterr().err
    assert e.value.code == 2
    assert f"no flag {short} (flags are spelled out in full, never abbreviated); did you mean {full}?" in err
    assert err.count("\n") == 1 and "usage:" not in err  # one line, no usage dump


@pytest.mark.parametrize("name", STAGES)
def test_every_stage_names_the_nearest_flag_to_a_misspelled_one(name, monkeypatch, capsys):
    parser = _parser_of(name, monkeypatch)
    monkeypatch.undo()
    _, full = abbreviation(parser)
    typo = full[:3] + full[4:]  # its second letter left out
    with pytest.raises(SystemExit) as e:
        parser.parse_args([*REQUIRED.get(name, []), typo, "1"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and f"no flag {typo}; did you mean {full}?" in err and err.count("\n") == 1


def test_other_parse_errors_are_one_line_too(capsys):
    import train_translator

    with pytest.raises(SystemExit) as e:
        train_translator.parse_args(["--key-space", "sideways"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and "usage:" not in err
    assert "argument --key-space: invalid choice: 'sideways'" in err and "--help" in err
    with pytest.raises(SystemExit):
        train_translator.parse_args(["--updates", "10", "stray"])
    assert "unexpected argument 'stray'" in capsys.readouterr().err


def test_make_train_with_an_abbreviated_flag_is_refused_and_writes_nothing(tmp_path):
    """As the issue's user typed it: without the refusal, argparse read `--update 10` as `--updates 10` and
    overwrote the demo's translator."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    roots = f"--artifacts {tmp_path / 'artifacts'} --results {tmp_path / 'results'}"
    out = subprocess.run(
        ["make", "--no-print-directory", "train", "PROFILE=demo", f"TRAIN_ARGS=--update 10 {roots}"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode != 0
    assert (
        "train_translator.py: no flag --update (flags are spelled out in full, never abbreviated); "
        "did you mean --updates?"
    ) in out.stderr
    assert list(tmp_path.iterdir()) == []


# --------------------------------------------------------------------------- --help examples
PATH_FLAGS = ("--large", "--small", "--source", "--tokenizer", "--init-from", "--data", "--ifeval-source")
OUTPUTS = ("artifacts/", "data/", "results/", "/tmp/", "kvlingo/toy/", "exports/")  # made by a stage or a user


def help_examples(parser) -> list[list[str]]:
    import shlex

    text = (parser.epilog or "").split("examples:", 1)[-1].replace("\\\n", " ")
    lines = [line.strip() for line in text.splitlines()]
    return [shlex.split(line)[1:] for line in lines if line.startswith(("python ", ".venv/bin/python "))]


@pytest.mark.parametrize("name", STAGES)
def test_every_help_example_parses_and_names_real_paths(name, monkeypatch, toy_pair):
    """A --help example runs as written after `make toy` (its toy paths exist) or after the stage that makes its
    inputs: no placeholder such as `--large runs/large`, `L` or `...`."""
    parser = _parser_of(name, monkeypatch)
    monkeypatch.undo()
    examples = help_examples(parser)
    assert examples, f"{name}: --help shows no example"
    for argv in examples:
        assert argv[0] == f"{name}.py", argv
        parser.parse_args(argv[1:])  # exits 2 on a flag it does not take
        for flag, value in zip(argv, argv[1:]):
            if flag not in PATH_FLAGS:
                continue
            if value.startswith("artifacts/toy/"):
                assert (toy_pair / value.removeprefix("artifacts/toy/")).exists(), f"{name}: {flag} {value}"
            else:
                assert value.startswith(OUTPUTS) or value.startswith("Qwen/"), f"{name}: {flag} {value}"

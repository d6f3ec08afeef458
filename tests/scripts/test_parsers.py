"""Every stage script's parser: its count and size flags are checked at parse time, an abbreviation (`--update
10`, which argparse would take as `--updates 10` and run) or a misspelling is refused with one line naming the
nearest real flag, and every `--help` example parses and names real paths."""

from __future__ import annotations

import argparse
import importlib
import re
from pathlib import Path

import pytest

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


STAGES = (
    "ablate",
    "benchmark",
    "export",
    "frontier",
    "ifeval",
    "prepare",
    "perf",
    "recipe",
    "switch_cost",
    "task_eval",
    "toy_world",
    "train_translator",
    "estimate",
    "summary",
    "gpu_check",
    "layers",
)  # serve_demo.py has subcommands, each its own parser; its --help runs below


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
            more = re.fullmatch(r"artifacts/toy/corpus/chats\.(\d+)\.jsonl", value)
            if more:  # not made by `make toy`: the example says how (toy_world.py --chats N)
                assert f"--chats {more[1]}" in parser.epilog, f"{name}: {flag} {value}: say how it is made"
            elif value.startswith("artifacts/toy/"):
                assert (toy_pair / value.removeprefix("artifacts/toy/")).exists(), f"{name}: {flag} {value}"
            else:
                assert value.startswith(OUTPUTS) or value.startswith("Qwen/"), f"{name}: {flag} {value}"


# Numeric flags left as plain int/float on purpose, with where they are checked instead.
UNBOUNDED = {
    "--seed": "any integer seeds the generator",
    "--seeds": "any integers; recipe.make_config refuses repeats",
    "--tolerance-scale": "negative on purpose forces every control to fail (benchmark's exit-path test)",
    "--max-accuracy-loss": "a bound on a difference of accuracies; negative is a stricter gate",
    "--lr-center": "recipe.make_config checks it after the profile's default is merged",
    "--grid-size": "recipe.make_config checks it after the profile's default is merged",
    "--max-extensions": "recipe.make_config checks it after the profile's default is merged",
    "--updates": "checked after the profile's default is merged (recipe.make_config, train_translator.positive)",
    **{
        flag: "train_translator.positive checks it after the profile's default is merged"
        for flag in (
            "--lr",
            "--batch",
            "--n-fit",
            "--val-every",
            "--checkpoint-every",
            "--aux-attn-weight",
            "--weight-decay",
            "--max-grad-norm",
        )
    },
}


class _Parsed(Exception):
    def __init__(self, parser):
        self.parser = parser


def _parser_of(name: str, monkeypatch) -> argparse.ArgumentParser:
    """The stage's own parser, caught as it starts parsing (nothing after parse_args runs)."""

    def catch(self, args=None, namespace=None):
        raise _Parsed(self)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", catch)
    module = importlib.import_module(name)
    entry = getattr(module, "parse_args", None) or module.main
    with pytest.raises(_Parsed) as got:
        entry(*(() if name == "toy_world" else ([],)))  # toy_world.main reads sys.argv itself
    return got.value.parser


@pytest.mark.parametrize("name", STAGES)
def test_every_count_and_size_flag_is_checked_at_parse_time(name, monkeypatch):
    parser = _parser_of(name, monkeypatch)
    plain = sorted(
        opt for a in parser._actions if a.type in (int, float) for opt in a.option_strings[:1] if opt not in UNBOUNDED
    )
    assert not plain, f"{name}: {plain} take any int/float; give them kvlingo.inputs.argtypes whole()/number()"


# --------------------------------------------------------------------------- --help as typed
ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = sorted(p.name for p in ROOT.glob("*.py"))


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_stage_script_prints_its_help_as_typed(script):
    """`python SCRIPT --help` at the repository root exits 0 with its usage, options and examples: argparse formats
    each flag's help with %, so a bare % in a help string (`tail:10%`) would crash the help of that one script."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, script, "--help"], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, f"{script} --help exits {out.returncode}: {out.stderr.strip().splitlines()[-1:]}"
    assert out.stdout.startswith(f"usage: {script}") and "options:" in out.stdout and "examples:" in out.stdout

"""Numeric flags are checked when they are parsed: a count of zero, a negative length or a NaN peak
ends the command with argparse's one-line error (status 2) before a model is built or a file is
written, and every stage's count and size flags carry such a check."""

from __future__ import annotations

import argparse
import importlib
from pathlib import Path

import pytest

from kvlingo.inputs.argtypes import number, whole
from kvlingo.inputs.models import PairError, resolve_device

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
)

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


def test_whole_takes_counts_from_its_minimum_and_names_the_bound():
    assert whole(1)("3") == 3 and whole(0)("0") == 0
    for bad, why in (("0", "below 1"), ("-4", "below 1"), ("x", "not a whole number"), ("1.5", "not a whole number")):
        with pytest.raises(argparse.ArgumentTypeError, match=why):
            whole(1)(bad)


def test_number_refuses_the_bound_itself_when_exclusive_and_anything_not_finite():
    assert number(above=0)("0.5") == 0.5 and number(at_least=0)("0") == 0.0
    for bad in ("0", "-1", "nan", "inf", "-inf"):
        with pytest.raises(argparse.ArgumentTypeError, match="> 0"):
            number(above=0)(bad)
    with pytest.raises(argparse.ArgumentTypeError, match="≥ 0"):
        number(at_least=0)("-0.1")
    with pytest.raises(argparse.ArgumentTypeError, match="not a number"):
        number(at_least=0)("fast")
    with pytest.raises(ValueError):
        number()


@pytest.mark.parametrize(
    "argv, flag",
    [
        (["--lengths", "0"], "--lengths"),
        (["--lengths", "1024", "-5"], "--lengths"),
        (["--new-turn-tokens", "0"], "--new-turn-tokens"),
        (["--timing-repeats", "0"], "--timing-repeats"),
        (["--timing-warmups", "-1"], "--timing-warmups"),
        (["--cv-limit", "-0.1"], "--cv-limit"),
        (["--max-seconds", "-1"], "--max-seconds"),
        (["--peak-tflops", "0"], "--peak-tflops"),
        (["--peak-gbps", "nan"], "--peak-gbps"),
    ],
)
def test_perf_refuses_a_bad_number_at_parse_time(argv, flag, capsys):
    import perf

    with pytest.raises(SystemExit) as e:
        perf.parse_args(["--arch", "tiny", *argv])
    assert e.value.code == 2
    assert f"argument {flag}:" in capsys.readouterr().err


def test_cv_limit_zero_still_parses_to_flag_every_timing():
    import perf

    assert perf.parse_args(["--cv-limit", "0"]).cv_limit == 0.0  # benchmark's exit-path test relies on it


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


def test_resolve_device_refuses_a_device_it_does_not_know():
    assert resolve_device("cpu") == "cpu"
    for bad in ("tpu", "cuda:x", "gpu", "CPU"):
        with pytest.raises(PairError, match="cuda \\(or cuda:N\\), mps, cpu or auto"):
            resolve_device(bad)


def test_writable_and_lock_run_make_the_folder_and_refuse_one_they_cannot_write(tmp_path):
    from kvlingo.errors import RunRefused
    from kvlingo.records.paths import writable
    from kvlingo.stages.skeleton import lock_run

    made = writable(tmp_path / "a" / "b", "--artifacts")
    assert made.is_dir() and not any(made.iterdir())  # the probe file is gone again
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    with pytest.raises(RunRefused, match=r"cannot write to .*a-file/b .*give --artifacts a folder you can write to"):
        writable(blocker / "b", "--artifacts")
    with pytest.raises(RunRefused, match=r"cannot write to .*a-file/run .*give --results a folder you can write to"):
        lock_run(blocker / "run", "benchmark")
    assert blocker.read_text() == "not a folder"


def test_perf_refuses_an_unwritable_results_folder_before_it_times_anything(tmp_path, capsys):
    import perf

    blocker = tmp_path / "results"
    blocker.write_text("a file where the results folder should be")
    with pytest.raises(SystemExit) as e:
        perf.main(["--arch", "tiny", "--device", "cpu", "--lengths", "32", "--results", str(blocker)])
    assert e.value.code == 2
    err = capsys.readouterr()
    assert "perf: cannot write to" in err.err and "--results" in err.err
    assert "GFLOP" not in err.out  # refused before the FLOP table, so before any timing
    assert blocker.read_text() == "a file where the results folder should be"


def test_a_run_name_stays_inside_the_output_roots():
    """--run names a folder under --artifacts and --results; an absolute name or a '..' part would write elsewhere."""
    from kvlingo.errors import RunRefused
    from kvlingo.records.paths import RunPaths

    assert RunPaths("qwen/lr1e-3", "a", "r").res == Path("r/qwen/lr1e-3")
    for bad in ("/tmp/x", "../x", "a/../../b", "./a", " "):
        with pytest.raises(RunRefused, match="must be a relative name"):
            RunPaths(bad)


def test_frontier_refuses_an_unknown_refresh_setting_at_parse_time(capsys):
    import frontier

    assert [str(s) for s in frontier.parse_args(["--settings", "none", "tail:10%"]).settings] == ["none", "tail:10%"]
    with pytest.raises(SystemExit) as e:
        frontier.parse_args(["--settings", "none", "bogus"])
    assert e.value.code == 2 and "argument --settings: refresh 'bogus' is not none" in capsys.readouterr().err

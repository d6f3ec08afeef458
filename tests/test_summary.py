"""The run's summary page: it refuses a run with no report (naming those that have some), and the commands a
stage suggests run as given (the run's profile and pair as make variables). The page itself, its figure, its
up-to-date check and its flags on cells of other maps are checked on a real run in test_demo_mini."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from kvlingo.io import atomic_write_json
from kvlingo.records.paths import make_command

ROOT = Path(__file__).resolve().parents[1]


def test_a_run_without_reports_is_refused_naming_the_runs_that_have_some(tmp_path, capsys):
    import summary

    for run in ("demo-l2s", "demo-l2s-recipe/lr1.00e-03-s42"):
        atomic_write_json(tmp_path / "results" / run / "train.json", {"stage": "train"})
    roots = ["--results", str(tmp_path / "results"), "--artifacts", str(tmp_path / "artifacts")]
    with pytest.raises(SystemExit) as e:
        summary.main(roots)  # the pilot profile's run, pilot-l2s, as `make summary` without PROFILE=demo
    err = capsys.readouterr()
    assert e.value.code == 2 and err.out == "" and err.err.count("\n") == 1
    assert "pilot-l2s holds no report" in err.err
    assert "runs with reports under" in err.err and "demo-l2s, demo-l2s-recipe/lr1.00e-03-s42" in err.err
    assert "`make summary RUN=demo-l2s`" in err.err
    assert not (tmp_path / "results" / "pilot-l2s").exists()  # nothing written


PAIRS = {
    "demo": (
        {
            "large": "artifacts/toy/large",
            "small": "artifacts/toy/small",
            "direction": "l2s",
            "device": "cpu",
            "dtype": "float32",
        },
        "demo-l2s",
        "make benchmark PROFILE=demo RUN=demo-l2s LARGE=artifacts/toy/large SMALL=artifacts/toy/small",
    ),
    "deep": (
        {
            "large": "artifacts/toy/large",
            "small": "artifacts/toy/mismatched",
            "direction": "l2s",
            "device": "cpu",
            "dtype": "float32",
        },
        "demo-large-deep-l2s",
        "make benchmark PROFILE=demo RUN=demo-large-deep-l2s LARGE=artifacts/toy/large SMALL=artifacts/toy/mismatched",
    ),
    "pilot": (
        {
            "large": "Qwen/Qwen3-1.7B",
            "small": "Qwen/Qwen3-0.6B",
            "direction": "s2l",
            "device": "cuda:0",
            "dtype": "bfloat16",
        },
        "pilot-s2l",
        "make benchmark PROFILE=pilot RUN=pilot-s2l LARGE=Qwen/Qwen3-1.7B SMALL=Qwen/Qwen3-0.6B DIRECTION=s2l "
        "DEVICE=cuda",
    ),
}


@pytest.mark.parametrize("name", PAIRS)
def test_a_suggested_make_command_runs_the_stage_on_the_run_and_pair_it_names(name):
    pair, run, expected = PAIRS[name]
    profile = "pilot" if name == "pilot" else "demo"
    command = make_command("benchmark", run, profile, pair)
    assert command == expected
    env = {**os.environ, "MAKEFLAGS": ""}
    out = subprocess.run([*command.split(), "-n"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    line = next(x for x in out.stdout.splitlines() if "benchmark.py" in x)
    device = pair["device"].split(":")[0]
    for flag in (
        f"--profile {profile}",
        f"--run {run}",
        f"--large {pair['large']}",
        f"--small {pair['small']}",
        f"--direction {pair['direction']}",
        f"--device {device}",
        f"--dtype {pair['dtype']}",
    ):
        assert flag in line, (flag, line)

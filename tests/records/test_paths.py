"""The run folders (kvlingo/records/paths.py): a run name stays inside the output roots, a folder that cannot be
written is refused, and a suggested make command runs the stage on the run and pair it names."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from kvlingo.records.paths import make_command


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


def test_a_run_name_stays_inside_the_output_roots():
    """--run names a folder under --artifacts and --results; an absolute name or a '..' part would write elsewhere."""
    from kvlingo.errors import RunRefused
    from kvlingo.records.paths import RunPaths

    assert RunPaths("qwen/lr1e-3", "a", "r").res == Path("r/qwen/lr1e-3")
    for bad in ("/tmp/x", "../x", "a/../../b", "./a", " "):
        with pytest.raises(RunRefused, match="must be a relative name"):
            RunPaths(bad)


ROOT = Path(__file__).resolve().parents[2]


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

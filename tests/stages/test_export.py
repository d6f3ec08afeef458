"""The export stage: it refuses a benchmark of other maps, and a benchmark report that is a folder; a refusal for
IFEval names a make command that makes the evidence, and one for the benchmark comes before it."""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from stagecli import refused
from toyrun import REFRESH, run_flags

import benchmark
import export
from kvlingo.io import read_json
from kvlingo.records.saved import load_state, save_translator

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: one torch thread per module


def test_a_benchmark_report_that_is_a_folder_is_named_as_one_by_export(benchmarked_run, tmp_path, capsys):
    """Once, export said that a benchmark.json which is a folder "does not exist"."""
    results = tmp_path / "results"
    (results / "r" / "benchmark.json").mkdir(parents=True)
    err = refused(
        export.main,
        [
            "--run",
            "r",
            "--artifacts",
            str(benchmarked_run["root"] / "artifacts"),
            "--results",
            str(results),
            "--out",
            str(tmp_path / "export"),
        ],
        capsys,
    )
    assert f"{results / 'r' / 'benchmark.json'} is a folder, not a report: remove it" in err, err
    assert not (tmp_path / "export").exists()


def test_export_refuses_a_benchmark_of_other_maps(toy_run, tmp_path, capsys):
    root = tmp_path / "run"
    for part in ("artifacts", "results"):
        shutil.copytree(toy_run["root"] / part / "toy", root / part / "toy")
    shutil.rmtree(root / "artifacts" / "toy" / "export")
    other = read_json(toy_run["maps"] / "manifest.json")
    state = load_state(toy_run["maps"])
    with torch.no_grad():
        next(iter(state.parameters())).add_(1.0)
    save_translator(root / "artifacts" / "toy" / "distilled", state, {k: other[k] for k in ("direction", "models")})
    with pytest.raises(SystemExit) as err:
        export.main(run_flags(root, "toy"))
    assert err.value.code == 2 and not (root / "artifacts" / "toy" / "export").exists()
    assert "scored another distilled translator" in capsys.readouterr().err
    (root / "results" / "toy" / "benchmark.json").unlink()
    with pytest.raises(SystemExit) as err:
        export.main(run_flags(root, "toy"))
    err = capsys.readouterr().err  # the command runs as given: the run's profile and pair (from its IFEval report)
    assert re.search(
        r"run `make benchmark PROFILE=tiny RUN=toy LARGE=\S+/large SMALL=\S+/small DEVICE=cpu "
        r"DTYPE=float32` first",
        err,
    ), err


def makefile_ifeval(command: str) -> None:
    """`make ifeval VAR=…` run here (the working folder is the repository root of the test's run): the Makefile's own
    ifeval.py lines, read from `make -n` at the project's root, each run in this folder (the prepare of EVAL_ROOT,
    then the scoring); the environment's set-up lines (uv, punkt) are the test session's own."""
    import ifeval

    words = shlex.split(command)
    assert words[:2] == ["make", "ifeval"], command
    dry = subprocess.run(
        ["make", "-n", "--no-print-directory", "-C", str(ROOT), *words[1:]], capture_output=True, text=True
    )
    assert dry.returncode == 0, dry.stderr
    lines = [shlex.split(x)[2:] for x in dry.stdout.splitlines() if " ifeval.py " in x and "--install-punkt" not in x]
    assert lines and "--prepare" not in lines[-1], dry.stdout
    for args in lines:
        ifeval.main(args)


def test_an_ifeval_of_other_maps_is_refused_with_a_make_command_that_scores_these(
    toy_run, tmp_path, capsys, monkeypatch
):
    """Once, exporting the closed-form maps of a run whose IFEval answered with the distilled ones suggested
    `make ifeval PROFILE=tiny RUN=…` alone: that scored the distilled maps again (and the export refused the same
    way), without the run's refresh, and, offline, without its IFEval prompts it could not prepare any. Typed as
    shown at the repository root, the command now makes the evidence, and the export goes through."""
    import nltk

    from kvlingo.eval.tasks import grader

    for part in ("artifacts", "results"):
        shutil.copytree(toy_run["root"] / part / "toy", tmp_path / part / "toy")
    art = tmp_path / "artifacts" / "toy"
    shutil.rmtree(art / "export")
    (art / "distilled").rename(art / "closed_form")  # a run of closed-form maps; its IFEval answered with others
    monkeypatch.chdir(tmp_path)  # the repository root: artifacts/, results/ and data/ are the stages' defaults
    pair = toy_run["pair"]
    flags = ["--large", str(pair / "large"), "--small", str(pair / "small"), "--device", "cpu", "--dtype", "float32"]
    bench_flags = ["--skip-missing", "--timing-conversations", "0", "--control-dtypes", "float32", "--refresh", REFRESH]
    benchmark.main(["--profile", "tiny", "--run", "toy", *flags, "--data", str(toy_run["data"]), *bench_flags])
    export_flags = ["--run", "toy", "--translator", "closed_form"]
    err = refused(export.main, export_flags, capsys)
    command = re.search(r"re-run `(make ifeval [^`]*)`", err)
    assert command and "answered with other maps" in err, err
    command = command[1]
    assert "TRANSLATOR=closed_form" in command and f"REFRESH={REFRESH}" in command, command
    assert f"IFEVAL_SOURCE={pair / 'corpus' / 'ifeval.jsonl'}" in command, command  # the run's local prompts
    nltk_home = tmp_path / "nltk_data"
    grader.install_punkt(nltk_home)
    try:
        makefile_ifeval(command)
    finally:
        nltk.data.path.remove(str(nltk_home.resolve()))
    export.main(export_flags)
    evidence = read_json(art / "export" / "evidence.json")
    assert evidence["translator"] == "closed_form" and evidence["ifeval"]["paths"]["translated"]["n"] > 0


def test_a_benchmark_that_cannot_prove_the_maps_is_named_before_their_ifeval(toy_run, tmp_path, capsys):
    """The export of closed-form maps benchmarked beside distilled ones (the control arm the distilled maps') is
    refused for its benchmark first: once, it asked for IFEval of these maps, which can take hours on a real pair, and
    then refused for the benchmark anyway."""
    for part in ("artifacts", "results"):
        shutil.copytree(toy_run["root"] / part / "toy", tmp_path / part / "toy")
    art = tmp_path / "artifacts" / "toy"
    shutil.copytree(art / "distilled", art / "closed_form")
    pair = toy_run["pair"]
    flags = ["--large", str(pair / "large"), "--small", str(pair / "small"), "--device", "cpu", "--dtype", "float32"]
    bench_flags = ["--timing-conversations", "0", "--control-dtypes", "float32", "--refresh", REFRESH]
    benchmark.main(
        ["--profile", "tiny", *run_flags(tmp_path, "toy"), *flags, "--data", str(toy_run["data"]), *bench_flags]
    )
    err = refused(export.main, [*run_flags(tmp_path, "toy"), "--translator", "closed_form"], capsys)
    assert "control arm used the distilled translator, not closed_form" in err and "make ifeval" not in err, err
    assert "`make train RUN=NAME TRAIN_ARGS=--closed-form-only`, then `make benchmark RUN=NAME`" in err, err

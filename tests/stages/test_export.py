"""The export stage: it refuses a benchmark of other maps, and a benchmark report that is a folder."""

from __future__ import annotations

import re
import shutil

import pytest
import torch
from stagecli import refused
from toyrun import run_flags

import export
from kvlingo.io import read_json
from kvlingo.records.saved import load_state, save_translator

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

"""The summary stage: it refuses a run with no report, naming those that have some. The page itself, its figure,
its up-to-date check and its flags on cells of other maps are checked on a real run in tests/scripts/test_demo.py;
the commands a stage suggests in tests/records/test_paths.py."""

from __future__ import annotations

import pytest

from kvlingo.io import atomic_write_json


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

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


def test_the_task_panel_says_not_run_and_reads_in_percent():
    """A run with a benchmark but no IFEval or task report: the figure's task panel says so and how to fill it, on
    a 0–100 axis."""
    from unittest import mock

    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.axes import Axes

    from kvlingo.stages import summary

    texts, limits = [], []
    real_text, real_ylim = Axes.text, Axes.set_ylim

    def text(ax, *a, **k):
        texts.append(a[2] if len(a) > 2 else k.get("s"))
        return real_text(ax, *a, **k)

    def ylim(ax, *a, **k):
        limits.append(a)
        return real_ylim(ax, *a, **k)

    page = summary.Page.__new__(summary.Page)
    page.bench = {"n_samples": {"conversations": 4}}
    kl = {"mean": 0.5, "se": 0.1, "n": 4}
    table = {arm: [summary.Cell(arm), summary.Cell("0.5", kl)] + [summary.Cell("—")] * 5 for arm in summary.ARMS}
    with mock.patch.object(Axes, "text", text), mock.patch.object(Axes, "set_ylim", ylim):
        png = summary.plot(page, ["arm", "KL/token"], table, "t", "")
    assert png[:4] == b"\x89PNG"
    assert any(t and t.startswith("not run: no IFEval or task report") for t in texts), texts
    assert (0, 100) in limits, limits

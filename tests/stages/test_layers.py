"""The per-layer diagnostic's stage on the tiny pair: what its page says it scored."""

from __future__ import annotations

import json

import pytest

import layers

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: one torch thread per module


def test_a_limit_past_the_data_is_noted_and_the_page_states_the_real_n(finished, tmp_path, capsys):
    """Once, `--limit 1000` on a 256-conversation split printed nothing and the page said "first 1000
    conversations" while the report's n_samples said 256. Now a one-line note, and the page states the n scored."""
    argv = [*finished["pair"], *finished["run"], "--data", str(finished["data"]), "--results", str(tmp_path)]
    report = layers.main([*argv, "--limit", "1000", "--out", "lim"])
    out = capsys.readouterr().out
    assert "note: --limit 1000 but the data holds 4 conversations; scoring all of them" in out
    n = report["n_samples"]
    assert n["conversations"] == 4 and json.loads((tmp_path / "lim" / "layers.json").read_text())["n_samples"] == n
    page = (tmp_path / "lim" / "layers.md").read_text()
    assert f"first 4 conversations ({n['reply_tokens']} reply tokens)" in page and "1000" not in page

    layers.main([*argv, "--limit", "2", "--out", "lim2"])  # within the data: no note, the page says 2
    assert "note:" not in capsys.readouterr().out
    assert "first 2 conversations" in (tmp_path / "lim2" / "layers.md").read_text()


def test_the_report_is_named_after_the_run_so_another_pair_does_not_replace_it(finished, tmp_path):
    """`make layers PAIR=deep` once wrote results/demo-l2s-layers, the 4-layer pair's folder, replacing its report.
    The default folder is now RUN-layers (make passes the deep pair's RUN, demo-deep-l2s), PROFILE-DIRECTION-layers
    without --run."""
    argv = [*finished["pair"], *finished["run"], "--data", str(finished["data"]), "--results", str(tmp_path)]
    layers.main([*argv, "--runs", "r"])
    assert (tmp_path / "r-layers" / "layers.json").is_file()
    runless = [a for i, a in enumerate(argv) if a != "--run" and (i == 0 or argv[i - 1] != "--run")]
    layers.main([*runless, "--runs", "r"])
    assert (tmp_path / "tiny-l2s-layers" / "layers.json").is_file()
